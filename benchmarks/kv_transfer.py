"""PD KV transfer throughput: a prefill engine (P) and a decode engine (D) on one host, PullConnector over each
transport (zmq; mooncake: Mooncake's Transfer Engine over TCP).

    PYTHONPATH=. python benchmarks/kv_transfer.py [--prompt-lens 512 2048 8192] [--repeats 3] [--transports zmq mooncake]

P runs in its own process (tests/kv_transfer/prefill_engine_process.py); D in this one. For each prompt length P
prefills one random prompt (max_tokens=1) and D pulls its blocks: the figure is the KV bytes D received over the
seconds from sending the read to having written the last block (zmq: P's gather, the TCP loopback, D's scatter;
mooncake: the Transfer Engine's reads cache to cache), as the consumer's worker counts them; the best of --repeats.
The transports take turns per prompt length, each with its own P and D. The model is a random Llama (4 layers, 8 KV heads of 64,
float32: 16 KiB of KV per token), so 8k tokens move 128 MiB.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from pagedserve import LLM, SamplingParams  # noqa: E402

DRIVER = os.path.join(ROOT, "tests", "kv_transfer", "prefill_engine_process.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transports", nargs="+", default=["zmq", "mooncake"], choices=["zmq", "mooncake"])
    args = parser.parse_args()
    from tiny_models import build_tiny_model

    max_len = max(args.prompt_lens) + 64
    model = build_tiny_model("llama", tempfile.mkdtemp(prefix="pagedserve-pd-bench-"), hidden_size=512,
                             intermediate_size=1024, num_attention_heads=8, num_key_value_heads=8,
                             num_hidden_layers=4, max_position_embeddings=max_len)
    blocks = 2 * (max_len // 16 + 2)
    engine_kwargs = dict(max_model_len=max_len, num_kv_blocks=blocks, block_size=16, native_decode_stack=False,
                         num_cpu_threads=1, enable_prefix_caching=False)
    pairs = {transport: PrefillDecodePair(model, engine_kwargs, transport) for transport in args.transports}
    rng = random.Random(0)
    print("| transport | prompt tokens | KV bytes | best load time | throughput |")
    print("|---|---|---|---|---|")
    try:
        for prompt_len in args.prompt_lens:
            for transport, pair in pairs.items():
                best = None
                for _ in range(args.repeats):
                    num_bytes, seconds = pair.pull([rng.randrange(8, 400) for _ in range(prompt_len)])
                    if best is None or seconds < best[1]:
                        best = (num_bytes, seconds)
                assert best is not None
                print(f"| {transport} | {prompt_len} | {best[0] / 2**20:.1f} MiB | {best[1] * 1000:.1f} ms | "
                      f"{best[0] / best[1] / 1e9:.2f} GB/s |", flush=True)
    finally:
        for pair in pairs.values():
            pair.close()


class PrefillDecodePair:
    """P in its own process, D in this one, over one transport."""

    def __init__(self, model: str, engine_kwargs: dict, transport: str) -> None:
        extra = {"transport": transport}
        env = dict(os.environ, PYTHONPATH=ROOT)
        self.producer = subprocess.Popen([sys.executable, DRIVER, model, json.dumps(engine_kwargs | {
            "kv_transfer_config": {"kv_connector": "PullConnector", "kv_role": "kv_producer",
                                   "kv_connector_extra_config": extra}})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert json.loads(self.producer.stdout.readline()).get("ready")
        self.consumer = LLM(model, kv_transfer_config={"kv_connector": "PullConnector", "kv_role": "kv_consumer",
                                                       "kv_load_failure_policy": "fail",
                                                       "kv_connector_extra_config": extra}, **engine_kwargs)
        self.connector = self.consumer.llm_engine.engine_core.executor.worker.kv_connector

    def pull(self, prompt: list[int]) -> tuple[int, float]:
        """P prefills `prompt`, D pulls its blocks: (bytes moved, seconds the load took)."""
        self.producer.stdin.write(json.dumps({"op": "prefill", "prompts": [prompt]}) + "\n")
        self.producer.stdin.flush()
        params = json.loads(self.producer.stdout.readline())["outputs"][0]["kv_transfer_params"]
        before_bytes, before_seconds = self.connector.num_loaded_bytes, self.connector.load_seconds
        output = self.consumer.generate([{"prompt_token_ids": prompt}], SamplingParams(
            temperature=0, max_tokens=1, extra_args={"kv_transfer_params": params}), use_tqdm=False)[0]
        assert output.outputs[0].finish_reason == "length", output.outputs[0].finish_reason
        return self.connector.num_loaded_bytes - before_bytes, self.connector.load_seconds - before_seconds

    def close(self) -> None:
        self.producer.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.producer.stdin.flush()
        self.producer.wait(timeout=60)
        self.consumer.llm_engine.shutdown()

if __name__ == "__main__":
    main()
