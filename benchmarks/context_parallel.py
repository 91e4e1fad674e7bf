"""Context parallel: one long-context request on a small DeepSeek-V3-style MLA model (16 heads, kv_lora_rank 128,
4 layers; random weights), decode context parallel (`--parallel dcp`, the default: two TP ranks with the KV
positions split, DCP=2, or not, DCP=1) or prefill context parallel (`--parallel pcp`: PCP=2, two processes splitting
the tokens and the KV positions, one thread each, against PCP=1, one process with two threads: the same two cores).

    PYTHONPATH=. python benchmarks/context_parallel.py [--parallel dcp|pcp] [--context 32768] [--output-len 32]
        [--num-layers 4] [--json-out PATH]

Reports per variant: the time to the first token of a `--context`-token prompt (chunked prefill, 2048-token
chunks), the decode time per token after it (the request's own token times), and the KV cache bytes the
request holds on each rank (its blocks x the bytes of one block over the layers). Both variants run on the 2-core
machine with one thread per rank, one after the other; DCP adds two all-gathers per layer and step and runs
its partial attention in plain PyTorch, so read the memory column as the gain and the times as the overhead.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pagedserve import LLM, SamplingParams  # noqa: E402
import native_guard  # noqa: E402


def model_folder(max_positions: int, num_layers: int) -> str:
    from tiny_models import build_tiny_model

    return build_tiny_model("deepseek-v3", tempfile.mkdtemp(prefix="pagedserve-dcp-bench-"), hidden_size=256,
                            num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=128, qk_nope_head_dim=32,
                            qk_rope_head_dim=16, v_head_dim=32, num_hidden_layers=num_layers,
                            max_position_embeddings=max_positions)


def measure(folder: str, prompt: list[int], output_len: int, parallel: str, degree: int) -> tuple[float, float, int]:
    """(seconds to the first token, seconds per later token, KV bytes the request holds per rank)."""
    if parallel == "dcp":
        layout = dict(tensor_parallel_size=2, decode_context_parallel_size=degree, num_cpu_threads=1)
    else:
        layout = dict(prefill_context_parallel_size=degree, num_cpu_threads=2 // degree)
    llm = LLM(folder, dtype="float32", max_model_len=len(prompt) + output_len + 16, max_num_batched_tokens=2048,
              enable_prefix_caching=False, max_num_seqs=1, **layout)
    try:
        runtime = llm.llm_engine.engine_core.runtime_info
        bytes_per_block = runtime.kv_cache_bytes // runtime.num_kv_blocks
        tokens_per_block = llm.llm_engine.engine_core.kv_cache_manager.block_size
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompt[:64]}], params, use_tqdm=False)  # warm-up
        output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        metrics = output.metrics
        first = metrics["first_token_time"] - metrics["arrival_time"]
        per_token = (metrics["last_token_time"] - metrics["first_token_time"]) / (output_len - 1)
        num_blocks = -(-(len(prompt) + output_len) // tokens_per_block)
        return first, per_token, num_blocks * bytes_per_block
    finally:
        llm.llm_engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parallel", choices=("dcp", "pcp"), default="dcp")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-layers", type=int, default=4,
                        help="decoder layers (fewer: a long context's prefill in less time; every layer does the same "
                             "work, so the ratios hold and the KV per rank scales with the count)")
    parser.add_argument("--json-out", default="", help="write the rows and the load average here ('' for none)")
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_kernels = native_guard.require_native_kernels(args.allow_plain_pytorch)
    if args.num_layers < 1:
        raise ValueError(f"--num-layers={args.num_layers} must be >= 1")
    folder = model_folder(args.context + args.output_len + 64, args.num_layers)
    rng = random.Random(0)
    prompt = [rng.randrange(8, 600) for _ in range(args.context)]
    if args.parallel == "dcp":
        print(f"context {args.context}, TP=2, 1 thread per rank, float32")
    else:
        print(f"context {args.context}, PCP=1: 1 process x 2 threads, PCP=2: 2 processes x 1 thread, float32")
    name = args.parallel.upper()
    print(f"{name:>4} {'TTFT s':>8} {'decode ms/token':>16} {'KV MiB per rank':>16} {'load average (1 min)':>22}")
    rows = []
    for degree in (1, 2):
        load_before = os.getloadavg()[0]
        first, per_token, kv_bytes = measure(folder, prompt, args.output_len, args.parallel, degree)
        load_after = os.getloadavg()[0]
        print(f"{degree:>4} {first:>8.2f} {per_token * 1e3:>16.1f} {kv_bytes / 2**20:>16.2f} "
              f"{load_before:>10.2f} / {load_after:.2f}", flush=True)
        rows.append({"parallel": args.parallel, "degree": degree, "context": args.context,
                     "output_len": args.output_len, "num_layers": args.num_layers, "ttft_s": first,
                     "decode_s_per_token": per_token, "kv_bytes_per_rank": kv_bytes,
                     "load_average_1min_start": load_before, "load_average_1min_end": load_after})
    if args.json_out:
        from cpu_kind import write_result_file

        write_result_file({"native_kernels": native_kernels, "results": rows}, args.json_out)


if __name__ == "__main__":
    main()
