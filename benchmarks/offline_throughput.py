"""Offline throughput: pagedserve vs HF transformers generate() on the same workload, side by side.

Workload (issue #2): 64 requests, prompts uniform in [64, 512] random token ids, outputs uniform in
[64, 256], ignore_eos, seed 0, on a random Llama of SmolLM2-135M's shape; both cores. transformers runs
static batches of 16 (left-padded, each batch generates to its longest request; only requested tokens
count). Prints output tokens/s for each engine and the ratio.

    python benchmarks/offline_throughput.py --dtype bfloat16 [--num-requests 64] [--skip-hf]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_model import benchmark_model_folder  # noqa: E402
import native_guard  # noqa: E402


def make_workload(num_requests: int, seed: int, vocab_size: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int]) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
            for _ in range(num_requests)]


class PagedserveOfflineRunner:
    """One loaded engine that times the workload once per `run()` (a fresh prefix cache each time)."""

    def __init__(self, folder: str, workload, dtype: str, **engine_kwargs) -> None:
        from pagedserve import LLM, SamplingParams

        start = time.perf_counter()
        self.llm = LLM(folder, dtype=dtype, **engine_kwargs)
        self.load_s = time.perf_counter() - start
        self.dtype = dtype
        self.prompts = [{"prompt_token_ids": p} for p, _ in workload]
        self.params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
                       for _, n in workload]
        self.num_output = sum(n for _, n in workload)
        # Warm-up (first-touch of weights and caches), not timed.
        self.llm.generate(self.prompts[:2], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * 2,
                          use_tqdm=False)

    def run(self) -> float:
        # A fresh prefix cache for every run: a repeat must not hit the previous run's prompt blocks.
        self.llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        seconds = time.perf_counter() - start
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == self.num_output
        return seconds

    def result(self, runs_s: list[float]) -> dict:
        """The best run (all are listed)."""
        elapsed = min(runs_s)
        return {"engine": "pagedserve", "dtype": self.dtype, "seconds": elapsed, "output_tokens": self.num_output,
                "output_tokens_per_s": self.num_output / elapsed, "load_s": self.load_s, "runs_s": runs_s}


def run_pagedserve(folder: str, workload, dtype: str, repeats: int = 1, **engine_kwargs) -> dict:
    """Loads the engine once and times the workload `repeats` times; reports the best run (all are listed)."""
    runner = PagedserveOfflineRunner(folder, workload, dtype, **engine_kwargs)
    return runner.result([runner.run() for _ in range(repeats)])


def run_transformers(folder: str, workload, dtype: str, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
    model.eval()
    num_output = 0
    start = time.perf_counter()
    for begin in range(0, len(workload), batch_size):
        batch = workload[begin:begin + batch_size]
        max_len = max(len(p) for p, _ in batch)
        input_ids = torch.zeros(len(batch), max_len, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, (prompt, _) in enumerate(batch):
            input_ids[row, max_len - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, max_len - len(prompt):] = 1
        with torch.no_grad():
            model.generate(input_ids, attention_mask=attention_mask, do_sample=False,
                           max_new_tokens=max(n for _, n in batch), min_new_tokens=0, eos_token_id=None,
                           pad_token_id=0)
        num_output += sum(n for _, n in batch)
    elapsed = time.perf_counter() - start
    return {"engine": f"transformers (static batches of {batch_size})", "dtype": dtype, "seconds": elapsed,
            "output_tokens": num_output, "output_tokens_per_s": num_output / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--json-out", default=None)
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_kernels = native_guard.require_native_kernels(args.allow_plain_pytorch)
    torch.set_num_threads(os.cpu_count() or 2)
    folder = benchmark_model_folder()
    workload = make_workload(args.num_requests, args.seed, 49152, (64, 512), (64, 256))
    engine_kwargs = {}
    if args.max_num_batched_tokens:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    results = [run_pagedserve(folder, workload, args.dtype, **engine_kwargs)]
    if not args.skip_hf:
        results.append(run_transformers(folder, workload, args.dtype, args.hf_batch_size))
    for result in results:
        print(f"{result['engine']:<40} {result['dtype']:<9} {result['output_tokens']:>6} tokens "
              f"{result['seconds']:>8.1f} s {result['output_tokens_per_s']:>8.1f} tok/s")
    if len(results) == 2:
        print(f"ratio pagedserve / transformers: {results[0]['output_tokens_per_s'] / results[1]['output_tokens_per_s']:.2f}x")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"native_kernels": native_kernels, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
