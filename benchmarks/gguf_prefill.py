"""Prefill on a GGUF file's kept blocks: the time of one N-token prompt plus its first output token (random token
ids, the prefix cache reset before each run), per prompt length, best of --repeats after a warm-up.

At the amx level a prefill chunk's Q8_0, Q4_0, Q4_1 and Q4_K products run on the GGUF kernel's amx unit; the other
types, and every type below that level, dequantize tiles of the weight for F.linear (layers/gguf_linear.py
runs_on_kernel). `PAGEDSERVE_CPU_ISA=avx512_bf16` on an AMX machine keeps the same vector products and leaves the amx
unit out, so a run at each level shows what the unit gives:

    python benchmarks/gguf_prefill.py --gguf FILE [--tokens 128 512] [--repeats 3]
    PAGEDSERVE_CPU_ISA=avx512_bf16 python benchmarks/gguf_prefill.py --gguf FILE
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import native_guard  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True, help="the GGUF file (large_gguf.py's models, a Q4_K_M file)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--repeats", type=int, default=3)
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_guard.require_native_kernels(args.allow_plain_pytorch)
    from pagedserve import LLM, SamplingParams
    from pagedserve.kernels import cpu_isa
    from pagedserve.layers.gguf_linear import gguf_linear_products

    max_tokens = max(args.tokens)
    llm = LLM(args.gguf, max_model_len=max_tokens + 16, max_num_batched_tokens=max_tokens, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    rng = random.Random(0)
    print(f"ISA level {cpu_isa.describe()}; GGUF product units {list(gguf_linear_products())}; {args.gguf}")
    for num_tokens in args.tokens:
        times = []
        for _ in range(args.repeats + 1):  # the first run warms up
            prompt = {"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(num_tokens)]}
            llm.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        best = min(times[1:])
        print(f"{num_tokens:>5} tokens: {best:.3f} s ({num_tokens / best:.0f} prompt tokens/s; runs "
              f"{', '.join(f'{t:.3f}' for t in times[1:])})")


if __name__ == "__main__":
    main()
