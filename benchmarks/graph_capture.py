"""Graph capture on the CPU: start time (eager, compiled cold, compiled warm) and decode step time.

Each configuration runs in its own process (so a "warm" start really is a new process that finds only
the on-disk cache): the SmolLM2-shaped random Llama (benchmark_model.py), one prompt of 32 tokens, 64
greedy decodes at batch 1 and at batch 8. Decode step time = (time of 65 output tokens - time of 1) / 64.

    python benchmarks/graph_capture.py --dtype bfloat16 [--ladder 1,2,4,8] [--output results/graph_capture.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import native_guard

HERE = os.path.dirname(os.path.abspath(__file__))


def run_one(dtype: str, mode: str, cache_dir: str, ladder: list[int]) -> dict:
    sys.path.insert(0, HERE)
    from benchmark_model import benchmark_model_folder

    from pagedserve import LLM, SamplingParams

    folder = benchmark_model_folder()
    compilation = {"mode": mode, "cache_dir": cache_dir, "cudagraph_capture_sizes": ladder}
    started = time.perf_counter()
    llm = LLM(folder, dtype=dtype, max_model_len=1024, num_kv_blocks=512, max_num_batched_tokens=256,
              compilation_config=compilation)
    start_seconds = time.perf_counter() - started
    result = {"dtype": dtype, "mode": mode, "start_seconds": start_seconds}
    forward = llm.llm_engine.engine_core.executor.worker.model_runner.forward
    if hasattr(forward, "stats"):
        result.update(compiled=forward.is_compiled, cache_hits=forward.stats.num_cache_hits,
                      cache_misses=forward.stats.num_cache_misses, replacements=forward.stats.num_replacements)
    for batch in (1, 8):
        prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 40000 + 3 for j in range(32)]} for i in range(batch)]

        def timed(max_tokens: int, prompts: list = prompts) -> float:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            begin = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - begin

        timed(2)  # warm-up
        prefill = min(timed(1) for _ in range(2))
        full = min(timed(65) for _ in range(2))
        result[f"decode_ms_batch{batch}"] = (full - prefill) / 64 * 1000
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--ladder", default="1,2,4,8")
    parser.add_argument("--output", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: mode:cache_dir
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    ladder = [int(size) for size in args.ladder.split(",")]
    if args.one:
        mode, cache_dir = args.one.split(":", 1)
        print("RESULT " + json.dumps(run_one(args.dtype, mode, cache_dir, ladder)), flush=True)
        return
    native_kernels = native_guard.require_native_kernels(args.allow_plain_pytorch)
    cache_dir = tempfile.mkdtemp(prefix="pagedserve-compile-bench-")
    results = []
    for label, mode in (("eager", "none"), ("compiled cold", "compile"), ("compiled warm", "compile")):
        output = subprocess.run([sys.executable, __file__, "--dtype", args.dtype, "--ladder", args.ladder,
                                 "--one", f"{mode}:{cache_dir}"], check=True, capture_output=True, text=True).stdout
        result = json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[7:])
        result["label"] = label
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"native_kernels": native_kernels, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
