"""Async scheduling: how long the worker sits idle between steps, synchronous vs async_scheduling=True.

    python benchmarks/async_scheduling.py [--model benchmark|tiny] [--requests 32] [--output-len 64]

The worker's execute_model is wrapped with timestamps. Idle time is the gap between the end of one step
and the start of the next on the worker — with synchronous scheduling that gap holds the engine's
update, output processing and the next schedule; with async scheduling the next step is already queued,
so the gap is only the hand-over. Both variants run in the same process, one after the other (timings on
shared cores are noisy: read the ratio). Also prints the generation wall time and output tokens/s.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pagedserve import LLM, SamplingParams  # noqa: E402
import native_guard  # noqa: E402


def model_folder(kind: str) -> str:
    if kind == "tiny":
        from tiny_models import build_tiny_model

        return build_tiny_model("llama", tempfile.mkdtemp(prefix="pagedserve-async-bench-"))
    from benchmark_model import benchmark_model_folder

    return benchmark_model_folder()


def measure(folder: str, async_scheduling: bool, prompts: list[list[int]], output_len: int,
            dtype: str, num_cpu_threads: int | None) -> dict[str, float]:
    llm = LLM(folder, dtype=dtype, max_model_len=1024, async_scheduling=async_scheduling,
              enable_prefix_caching=False, num_cpu_threads=num_cpu_threads)
    worker = llm.llm_engine.engine_core.executor.worker
    spans: list[tuple[float, float]] = []
    execute_model = worker.execute_model

    def timed_execute_model(scheduler_output):
        start = time.perf_counter()
        try:
            return execute_model(scheduler_output)
        finally:
            spans.append((start, time.perf_counter()))

    worker.execute_model = timed_execute_model
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm-up
    spans.clear()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    spans.sort()
    gaps = [max(0.0, nxt[0] - prev[1]) for prev, nxt in zip(spans, spans[1:])]
    busy = sum(end - begin for begin, end in spans)
    llm.llm_engine.shutdown()
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    median_gap = sorted(gaps)[len(gaps) // 2] if gaps else 0.0
    return dict(steps=len(spans), idle_s=sum(gaps), busy_s=busy, wall_s=wall, idle_p50_ms=1000 * median_gap,
                idle_per_step_ms=1000 * sum(gaps) / max(len(gaps), 1), tokens_per_s=num_tokens / wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["benchmark", "tiny"], default="benchmark")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-cpu-threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="alternate sync/async this many times; the run with the median wall time counts")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="sys.setswitchinterval for both runs (the GIL hand-off period; Python's default is 5)")
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_guard.require_native_kernels(args.allow_plain_pytorch)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    folder = model_folder(args.model)
    rng = random.Random(0)
    prompts = [[rng.randrange(8, 400) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    runs: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    for _ in range(args.repeats):
        for name in runs:
            runs[name].append(measure(folder, name == "async", prompts, args.output_len, args.dtype,
                                      args.num_cpu_threads))
    results = {name: sorted(rs, key=lambda r: r["wall_s"])[len(rs) // 2] for name, rs in runs.items()}
    print(f"model={args.model} dtype={args.dtype} requests={args.requests} prompt_len={args.prompt_len} "
          f"output_len={args.output_len} repeats={args.repeats} num_cpu_threads={args.num_cpu_threads} "
          f"switch_interval={sys.getswitchinterval() * 1000:g} ms")
    print(f"{'':6} {'steps':>6} {'idle s':>8} {'idle/step ms':>13} {'p50 ms':>8} {'busy s':>8} {'wall s':>8} "
          f"{'tok/s':>8}")
    for name, r in results.items():
        print(f"{name:6} {r['steps']:6d} {r['idle_s']:8.3f} {r['idle_per_step_ms']:13.3f} {r['idle_p50_ms']:8.3f} "
              f"{r['busy_s']:8.3f} "
              f"{r['wall_s']:8.3f} {r['tokens_per_s']:8.1f}")
    sync, asynchronous = results["sync"], results["async"]
    print(f"idle time async/sync: {asynchronous['idle_s'] / max(sync['idle_s'], 1e-9):.3f}  "
          f"(idle per step {asynchronous['idle_per_step_ms']:.3f} ms vs {sync['idle_per_step_ms']:.3f} ms); "
          f"throughput async/sync: {asynchronous['tokens_per_s'] / sync['tokens_per_s']:.3f}")


if __name__ == "__main__":
    main()
