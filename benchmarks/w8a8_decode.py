"""W8A8 int8 against bf16 on SmolLM2-135M-Instruct's real weights, decode throughput, one process, one run.

The default model's GGUF weights (dequantized to float32) are exported as an HF folder, `pagedserve quantize`
writes its W8A8 checkpoint (per-token dynamic activations), and two engines, bf16 and W8A8 (activations bf16),
alternate over the same workload: `batch` requests of `prompt_tokens` random token ids generating `max_tokens`
tokens each (ignore_eos, greedy). Reported: output tokens/s of each, the ratio, and the first request's first 16
tokens of both (a sanity check: W8A8 follows bf16 closely, not token for token). Both folders are cached under
~/.cache/pagedserve/benchmark-models.

    python benchmarks/w8a8_decode.py [--batch 1 16] [--rounds 3] [--out benchmarks/results/w8a8_decode_<cpu>.json]
    python benchmarks/w8a8_decode.py --recipe-a 16 [--rounds 2]   # recipe A's workload (offline_throughput.py)

Both engines get the same KV cache size (two engines in one process would otherwise size the second one's cache
from the memory the first left).

The vLLM CPU comparison runs vLLM 0.32 on the same W8A8 folder (printed at the end) with the same workload.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

import native_guard

ROOT = os.path.join(os.path.expanduser("~"), ".cache", "pagedserve", "benchmark-models")


def smollm2_folders() -> tuple[str, str]:
    """(float32 HF folder of SmolLM2-135M-Instruct, its W8A8 folder), made once."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchmark_model import default_model_hf_folder

    from pagedserve.quantization.quantize_checkpoint import quantize_checkpoint

    folder, quantized = default_model_hf_folder(ROOT), os.path.join(ROOT, "smollm2-135m-instruct-w8a8")
    if not os.path.isfile(os.path.join(quantized, "model.safetensors")):
        quantize_checkpoint(folder, quantized)
    return folder, quantized


def run_recipe_a(folder: str, quantized: str, num_requests: int, rounds: int, out: str | None,
                 native_kernels: dict) -> None:
    """Recipe A (prompts U[64, 512], outputs U[64, 256], greedy, ignore_eos) on both engines, rounds alternating."""
    from offline_throughput import PagedserveOfflineRunner, make_workload

    workload = make_workload(num_requests, 0, 49152, (64, 512), (64, 256))
    runners = {name: PagedserveOfflineRunner(path, workload, "bfloat16", max_model_len=1024, kv_cache_memory="4GiB")
               for name, path in (("bf16", folder), ("w8a8", quantized))}
    runs: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, runner in runners.items():
            runs[name].append(runner.run())
    results = {name: runner.result(runs[name]) for name, runner in runners.items()}
    ratios = [bf16 / w8a8 for bf16, w8a8 in zip(runs["bf16"], runs["w8a8"])]
    summary = {"native_kernels": native_kernels, "num_requests": num_requests, "results": results,
               "w8a8_over_bf16_per_round": ratios}
    print(f"recipe A, {num_requests} requests: bf16 {results['bf16']['output_tokens_per_s']:.1f} tok/s, "
          f"w8a8 {results['w8a8']['output_tokens_per_s']:.1f} tok/s, w8a8/bf16 per round "
          f"{', '.join(f'{r:.2f}' for r in ratios)}", flush=True)
    if out:
        with open(out, "w") as handle:
            json.dump(summary, handle, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--recipe-a", type=int, default=0, metavar="NUM_REQUESTS",
                        help="run recipe A's workload with this many requests instead of the decode batches")
    parser.add_argument("--out", default=None)
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_kernels = native_guard.require_native_kernels(args.allow_plain_pytorch)

    from pagedserve import LLM, SamplingParams

    folder, quantized = smollm2_folders()
    if args.recipe_a:
        run_recipe_a(folder, quantized, args.recipe_a, args.rounds, args.out, native_kernels)
        return
    engines = {"bf16": LLM(folder, dtype="bfloat16", max_model_len=512, kv_cache_memory="1GiB"),
               "w8a8": LLM(quantized, dtype="bfloat16", max_model_len=512, kv_cache_memory="1GiB")}
    rng = random.Random(0)
    result: dict = {"native_kernels": native_kernels, "torch_threads": torch.get_num_threads(), "batches": {}}
    for batch in args.batch:
        prompts = [{"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(args.prompt_tokens)]}
                   for _ in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
        for llm in engines.values():  # warm-up
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        times: dict[str, list[float]] = {name: [] for name in engines}
        first_tokens: dict[str, list[int]] = {}
        for _ in range(args.rounds):
            for name, llm in engines.items():  # alternating, so drift on the shared machine hits both
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                times[name].append(time.perf_counter() - start)
                first_tokens[name] = list(outputs[0].outputs[0].token_ids[:16])
        tokens = batch * args.max_tokens
        rates = {name: tokens / min(values) for name, values in times.items()}
        result["batches"][str(batch)] = {"tokens_per_s": rates, "w8a8_over_bf16": rates["w8a8"] / rates["bf16"],
                                         "first_tokens": first_tokens}
        print(f"batch {batch}: bf16 {rates['bf16']:.1f} tok/s, w8a8 {rates['w8a8']:.1f} tok/s, "
              f"w8a8/bf16 {rates['w8a8'] / rates['bf16']:.2f}x; first tokens bf16 {first_tokens['bf16']} "
              f"w8a8 {first_tokens['w8a8']}", flush=True)
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=2)
    print(f"vLLM CPU on the same checkpoint: the W8A8 folder is {quantized}")


if __name__ == "__main__":
    main()
