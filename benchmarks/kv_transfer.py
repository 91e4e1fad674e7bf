"""PD KV transfer throughput: a prefill engine (P) and a decode engine (D) on one host, PullConnector over each
transport (zmq; mooncake: Mooncake's Transfer Engine over TCP).

    PYTHONPATH=. python benchmarks/kv_transfer.py [--prompt-lens 512 2048 8192] [--repeats 3] [--transports zmq mooncake]
        [--mode pull push] [--max-num-batched-tokens N]

P runs in its own process (tests/kv_transfer/prefill_engine_process.py); D in this one. For each prompt length P
prefills one random prompt (max_tokens=1) and D pulls its blocks: the figure is the KV bytes D received over the
seconds from sending the read to having written the last block (zmq: P's gather, the TCP loopback, D's scatter;
mooncake: the Transfer Engine's reads cache to cache), as the consumer's worker counts them; the best of --repeats.
The transports take turns per prompt length, each with its own P and D. The model is a random Llama (4 layers, 8 KV heads of 64,
float32: 16 KiB of KV per token), so 8k tokens move 128 MiB.

--mode (kv_connector_extra_config.mode; default pull) adds each mode's TTFT: from the request's start to D's first
token, median of --repeats. pull: P prefills (max_tokens 1), then D pulls and computes the last prompt token. push
(zmq only): D gets the request first and sends P its push order, P is given the request at once and sends each
layer's KV from its forward, D runs once every layer arrived. "P done -> D first token" is what the transfer leaves
after P's prefill (the wall time P's request finished, from P, to D's first token): push hides the transfer when it
is smaller, and it is free of P's prefill time, which other jobs' load makes noisy. Push's "load time" runs from D's order to the last
layer, so it includes P's prefill (no throughput figure for it). On a loaded 2-core host compare ratios only.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from pagedserve import LLM, SamplingParams  # noqa: E402
import native_guard  # noqa: E402

DRIVER = os.path.join(ROOT, "tests", "kv_transfer", "prefill_engine_process.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transports", nargs="+", default=["zmq", "mooncake"], choices=["zmq", "mooncake"])
    parser.add_argument("--mode", nargs="+", default=["pull"], choices=["pull", "push"],
                        help="kv_connector_extra_config.mode values to run (push runs over zmq only)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="P's chunked prefill budget (default: the engine's)")
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_guard.require_native_kernels(args.allow_plain_pytorch)
    from tiny_models import build_tiny_model

    max_len = max(args.prompt_lens) + 64
    model = build_tiny_model("llama", tempfile.mkdtemp(prefix="pagedserve-pd-bench-"), hidden_size=512,
                             intermediate_size=1024, num_attention_heads=8, num_key_value_heads=8,
                             num_hidden_layers=4, max_position_embeddings=max_len)
    blocks = 2 * (max_len // 16 + 2)
    engine_kwargs = dict(max_model_len=max_len, num_kv_blocks=blocks, block_size=16, native_decode_stack=False,
                         num_cpu_threads=1, enable_prefix_caching=False)
    producer_kwargs = dict(engine_kwargs)
    if args.max_num_batched_tokens is not None:
        producer_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    pairs = {(mode, transport): PrefillDecodePair(model, engine_kwargs, transport, mode, producer_kwargs)
             for mode in args.mode for transport in args.transports if mode == "pull" or transport == "zmq"}
    rng = random.Random(0)
    print(f"load average at start: {os.getloadavg()}")
    print("| mode | transport | prompt tokens | KV bytes | best load time | throughput | median TTFT | "
          "median P done -> D first token |")
    print("|---|---|---|---|---|---|---|---|")
    try:
        runs: dict[tuple[int, tuple[str, str]], list[tuple[int, float, float, float]]] = {}
        for prompt_len in args.prompt_lens:
            # Rounds take the pairs in turn (a fresh prompt each), so load from other jobs falls on every pair alike.
            for _ in range(args.repeats):
                for key, pair in pairs.items():
                    runs.setdefault((prompt_len, key), []).append(
                        pair.run([rng.randrange(8, 400) for _ in range(prompt_len)]))
            for (mode, transport) in pairs:
                results = runs[(prompt_len, (mode, transport))]
                best = min(results, key=lambda result: result[1])
                ttfts = [result[2] for result in results]
                throughput = f"{best[0] / best[1] / 1e9:.2f} GB/s" if mode == "pull" else "-"
                print(f"| {mode} | {transport} | {prompt_len} | {best[0] / 2**20:.1f} MiB | {best[1] * 1000:.1f} ms "
                      f"| {throughput} | {statistics.median(ttfts) * 1000:.1f} ms | "
                      f"{statistics.median(result[3] for result in results) * 1000:.1f} ms |", flush=True)
            print("  TTFT runs (ms): " + "; ".join(
                f"{mode}/{transport} " + ", ".join(f"{result[2] * 1000:.0f}" for result in runs[(prompt_len,
                                                                                                 (mode, transport))])
                for mode, transport in pairs), flush=True)
    finally:
        for pair in pairs.values():
            pair.close()
    print(f"load average at end: {os.getloadavg()}")


class PrefillDecodePair:
    """P in its own process, D in this one, over one transport in one mode."""

    def __init__(self, model: str, engine_kwargs: dict, transport: str, mode: str = "pull",
                 producer_kwargs: dict | None = None) -> None:
        extra = {"transport": transport, "mode": mode}
        self.mode = mode
        env = dict(os.environ, PYTHONPATH=ROOT)
        self.producer = subprocess.Popen([sys.executable, DRIVER, model, json.dumps((producer_kwargs or engine_kwargs)
                                                                                    | {
            "kv_transfer_config": {"kv_connector": "PullConnector", "kv_role": "kv_producer", "engine_id": "prefill",
                                   "kv_connector_extra_config": extra}})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        ready = json.loads(self.producer.stdout.readline())
        assert ready.get("ready")
        self.producer_port = int(ready["port"])
        self.consumer = LLM(model, kv_transfer_config={"kv_connector": "PullConnector", "kv_role": "kv_consumer",
                                                       "kv_load_failure_policy": "fail",
                                                       "kv_connector_extra_config": extra}, **engine_kwargs)
        self.connector = self.consumer.llm_engine.engine_core.executor.worker.kv_connector
        self.count = 0

    def _ask(self, command: dict) -> dict:
        self.producer.stdin.write(json.dumps(command) + "\n")
        self.producer.stdin.flush()
        return json.loads(self.producer.stdout.readline())

    def run(self, prompt: list[int]) -> tuple[int, float, float, float]:
        """One request through P and D: (bytes moved, seconds the load took, TTFT seconds, seconds from P's
        prefill finishing to D's first token)."""
        before_bytes, before_seconds = self.connector.num_loaded_bytes, self.connector.load_seconds
        start = time.perf_counter()
        if self.mode == "pull":
            answer = self._ask({"op": "prefill", "prompts": [prompt]})["outputs"][0]
            params, producer_id = answer["kv_transfer_params"], answer["request_id"]
            output = self.consumer.generate([{"prompt_token_ids": prompt}], SamplingParams(
                temperature=0, max_tokens=1, extra_args={"kv_transfer_params": params}), use_tqdm=False)[0]
        else:
            self.count += 1
            producer_id, engine = f"bench-{self.count}", self.consumer.llm_engine
            engine.add_request(producer_id, {"prompt_token_ids": prompt}, SamplingParams(
                temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {
                    "do_remote_prefill": True, "remote_engine_id": "prefill", "remote_host": "127.0.0.1",
                    "remote_port": self.producer_port, "remote_block_ids": [], "remote_request_id": producer_id}}))
            engine.step()  # D reserves its blocks; its receiver sends P the push order
            self._ask({"op": "submit", "requests": [{"request_id": producer_id, "prompt": prompt}]})
            output = None
            while output is None:
                output = next((item for item in engine.step() if item.finished), None)
                if output is None:
                    time.sleep(0.001)  # D idles while P computes: leave P the cores
        ttft = time.perf_counter() - start
        first_token_at = time.time()
        assert output.outputs[0].finish_reason == "length", output.outputs[0].finish_reason
        # What the transfer leaves after P's prefill: P's finish to D's first token (one host, one wall clock).
        tail = first_token_at - self._ask({"op": "finished_at", "request_id": producer_id})["finished_at"]
        return (self.connector.num_loaded_bytes - before_bytes, self.connector.load_seconds - before_seconds,
                ttft, tail)

    def close(self) -> None:
        self.producer.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.producer.stdin.flush()
        self.producer.wait(timeout=60)
        self.consumer.llm_engine.shutdown()

if __name__ == "__main__":
    main()
