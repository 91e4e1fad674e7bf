"""The prefill attention kernel ('cpu_native'; bf16 on AMX or AVX512-BF16, fp32 on FMA) against torch_paged's SDPA
path, one layer.

One fresh prompt of each length (SmolLM2-135M attention: 9 heads over 3 KV heads, head_dim 64, block size 16,
shuffled blocks), plus a recipe-A-like step of several prompts (2048 tokens). Both run through the backends'
`forward` with the same K/V write, interleaved, best of --repeats; prints ms per layer and the ratio.

    python benchmarks/prefill_attention.py [--dtype bfloat16|float32] [--lengths 128 288 512 2048] [--repeats 10]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedserve.attention.backend import AttentionMetadata  # noqa: E402
from pagedserve.attention.cpu_native import CpuNativeAttentionBackend, is_prefill_attention_available  # noqa: E402
from pagedserve.attention.torch_paged import TorchPagedAttentionBackend  # noqa: E402
import native_guard  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def prefill_step(prompt_lens: list[int], dtype: torch.dtype, seed: int = 0):
    """query/key/value, a KV cache with shuffled blocks and the metadata of one step of fresh prompts."""
    rng = random.Random(seed)
    blocks_per_request = [-(-n // BLOCK_SIZE) for n in prompt_lens]
    block_ids = list(range(1, sum(blocks_per_request) + 1))
    rng.shuffle(block_ids)
    rows, slots, cursor = [], [], 0
    for count, length in zip(blocks_per_request, prompt_lens):
        row = block_ids[cursor:cursor + count]
        cursor += count
        rows.append(row + [0] * (max(blocks_per_request) - count))
        slots += [row[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(length)]
    starts = [0]
    for length in prompt_lens:
        starts.append(starts[-1] + length)
    num_tokens = starts[-1]
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens, slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(prompt_lens), block_table=torch.tensor(rows, dtype=torch.int32),
        max_query_len=max(prompt_lens), max_seq_len=max(prompt_lens), num_decodes=0, num_decode_tokens=0,
        query_start_loc_cpu=starts, seq_lens_cpu=list(prompt_lens), block_size=BLOCK_SIZE)
    generator = torch.Generator().manual_seed(seed)
    kv_cache = torch.zeros(2, len(block_ids) + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)

    def random_rows(heads: int) -> torch.Tensor:
        return torch.randn(num_tokens, heads, HEAD_DIM, generator=generator).to(dtype)

    return random_rows(NUM_HEADS), random_rows(NUM_KV_HEADS), random_rows(NUM_KV_HEADS), kv_cache, metadata


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 288, 512, 2048])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    native_guard.require_native_kernels(can_time_fallback=False)  # times native ops: no fallback to time
    if not is_prefill_attention_available():
        raise SystemExit("the prefill kernel is not available here (neither AMX-BF16 nor AVX512-BF16, or the native "
                         "build failed)")
    backends = {"torch_paged": TorchPagedAttentionBackend(), "cpu_native": CpuNativeAttentionBackend()}
    cases = [([n], f"1 x {n}") for n in args.lengths]
    mixed = [288, 129, 400, 64, 511, 300, 220, 136]  # 2048 tokens from 8 prompts, as a recipe-A prefill step
    cases.append((mixed, f"{len(mixed)} prompts, {sum(mixed)} tokens"))
    print(f"{'step':<28} {'torch_paged ms':>15} {'cpu_native ms':>14} {'ratio':>7}")
    for prompt_lens, label in cases:
        inputs = prefill_step(prompt_lens, getattr(torch, args.dtype))
        best = {name: float("inf") for name in backends}
        for _ in range(args.repeats):
            for name, backend in backends.items():
                start = time.perf_counter()
                backend.forward(*inputs, HEAD_DIM ** -0.5)
                best[name] = min(best[name], time.perf_counter() - start)
        print(f"{label:<28} {best['torch_paged'] * 1e3:>15.3f} {best['cpu_native'] * 1e3:>14.3f} "
              f"{best['torch_paged'] / best['cpu_native']:>6.2f}x")


if __name__ == "__main__":
    main()
