"""Batched greedy decode of the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) on its blocks kept quantized
against the same file dequantized to float32 at load (`gguf_dequantize=True`), side by side in one process.

Workload: N requests (`--batch`) of random prompts of U[64, 256] token ids (seed 0), 128 greedy output tokens each
with `ignore_eos`, all submitted at once. Both engines load first; each round times one run of each, the order
alternating. Reported per engine: output tokens/s of each run (prompts' prefill included) and the time of a
prefill-only run (the same prompts, one output token), then the ratio kept / dequantized of the best runs.
Kept blocks run on the GGUF kernel (layers/gguf_linear.py: its 'vector' unit up to 4 rows, 'amx' from 5 rows and for
prefill where the CPU has AMX-INT8); dequantized weights on the float32 layers.

    python benchmarks/gguf_batch_decode.py [--batch 1 16 64] [--rounds 2] [--json-out FILE]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_kind import result_path, write_result_file  # noqa: E402
import native_guard  # noqa: E402

MAX_TOKENS = 128


def timed(llm, prompts: list[dict], max_tokens: int) -> float:
    """Seconds to generate every prompt at once, the prefix cache reset first."""
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json-out", default=None)
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_kernels = native_guard.require_native_kernels(args.allow_plain_pytorch)
    from pagedserve import LLM
    from pagedserve.layers.gguf_linear import gguf_linear_products

    engines = {"kept": LLM(max_model_len=1024), "dequantized": LLM(max_model_len=1024, gguf_dequantize=True)}
    rng = random.Random(0)
    results: dict = {"native_kernels": native_kernels, "gguf_linear_products": list(gguf_linear_products()),
                     "max_tokens": MAX_TOKENS, "batches": {}}
    for batch in args.batch:
        prompts = [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(rng.randint(64, 256))]}
                   for _ in range(batch)]
        for llm in engines.values():  # warm-up
            timed(llm, prompts[:2], 4)
        runs: dict[str, dict[str, list[float]]] = {name: {"tokens_per_s": [], "prefill_s": []} for name in engines}
        for round_index in range(args.rounds):
            for name in (list(engines) if round_index % 2 == 0 else list(engines)[::-1]):
                runs[name]["tokens_per_s"].append(batch * MAX_TOKENS / timed(engines[name], prompts, MAX_TOKENS))
                runs[name]["prefill_s"].append(timed(engines[name], prompts, 1))
        best = {name: max(run["tokens_per_s"]) for name, run in runs.items()}
        results["batches"][str(batch)] = {"runs": runs, "best_tokens_per_s": best,
                                          "ratio_kept_over_dequantized": best["kept"] / best["dequantized"]}
        print(f"batch {batch:>3}: " + ", ".join(
            f"{name} {best[name]:.1f} tok/s (runs {', '.join(f'{v:.1f}' for v in run['tokens_per_s'])}; prefill "
            f"{min(run['prefill_s']):.2f} s)" for name, run in runs.items())
            + f"; kept / dequantized {best['kept'] / best['dequantized']:.2f}x", flush=True)
    path = args.json_out or result_path("gguf_batch_decode", "q4_1")
    write_result_file(results, path)


if __name__ == "__main__":
    main()
