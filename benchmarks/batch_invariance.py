"""Cost of batch_invariant=True: decode step time with the mode on and off.

Random Llama of SmolLM2-135M's shape (benchmark_model.py). For each batch size, `batch` requests with
128-token random prompts are prefilled, then 64 decode steps are timed; the two modes alternate within
one process (off, on, off, on, ... per batch size) so machine noise hits both alike. Both use the
torch_paged attention layout (the mode's invariant attention replaces its kernels). Reported per
(dtype, batch): mean and median decode step time in each mode and the on/off ratio of the medians.

    python benchmarks/batch_invariance.py [--dtype float32 bfloat16] [--batch 1 8 32] [--steps 64]
        [--threads N] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmark_model import SMOLLM2_SHAPE, benchmark_model_folder  # noqa: E402
import native_guard  # noqa: E402

PROMPT_TOKENS = 128


def decode_step_times(engine, batch: int, num_steps: int, seed: int) -> list[float]:
    from pagedserve import SamplingParams

    rng = random.Random(seed)
    vocab = SMOLLM2_SHAPE["vocab_size"]
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 1, ignore_eos=True, detokenize=False)
    for index in range(batch):
        engine.add_request(f"{seed}-{index}", {"prompt_token_ids": [rng.randrange(3, vocab)
                                                                    for _ in range(PROMPT_TOKENS)]}, params)
    engine.step()  # prefill (+ first token)
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default=None)
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_kernels = native_guard.require_native_kernels(args.allow_plain_pytorch)
    from pagedserve.engine.llm_engine import LLMEngine

    folder = benchmark_model_folder()
    rows = []
    for dtype in args.dtype:
        engines = {on: LLMEngine.from_kwargs(folder, dtype=dtype, max_model_len=1024, num_kv_blocks=1024,
                                             max_num_seqs=max(args.batch), enable_prefix_caching=False,
                                             attention_backend="torch_paged", num_cpu_threads=args.threads,
                                             batch_invariant=on)
                   for on in (False, True)}
        for batch in args.batch:
            times = {False: [], True: []}
            for round_index in range(2):  # off, on, off, on
                for on in (False, True):
                    times[on] += decode_step_times(engines[on], batch, args.steps // 2, seed=round_index)
            row = {"dtype": dtype, "batch": batch, "steps": len(times[False])}
            for on, label in ((False, "off"), (True, "on")):
                row[f"{label}_mean_ms"] = round(statistics.mean(times[on]) * 1000, 2)
                row[f"{label}_median_ms"] = round(statistics.median(times[on]) * 1000, 2)
            row["on_over_off"] = round(row["on_median_ms"] / row["off_median_ms"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
        for engine in engines.values():
            engine.shutdown()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"native_kernels": native_kernels, "results": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
