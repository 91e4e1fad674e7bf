"""Micro-benchmark: the native in-place paged decode kernel ('cpu_native') vs the torch_paged backend.

The decode shape of attention_micro.py (64 requests, contexts of 65-768 tokens, SmolLM2-135M attention:
9 heads, 3 KV heads, head_dim 64, block_size 16, shuffled blocks), one layer's decode step through each
backend's `forward` (K/V write + attention; the native backend differs only in how decodes are attended),
plus the kernel call alone, and one request with a long context (the flash-decoding split path).

Usage: python benchmarks/attention_native.py [--threads 2] [--repeats 20] [--num-requests 64] [--long 4096]
                                            [--clock wall|cpu] [--kv-cache-dtype auto|int8]
Prints min and median ms per layer over interleaved repeats and the torch_paged / cpu_native ratio.
With `--kv-cache-dtype int8` it times the native decode kernel alone over the same contexts with a bfloat16
cache and with that cache quantized to int8 pages (kv_cache_dtype="int8", bfloat16 query), and their ratio.
On a shared, oversubscribed machine use `--threads 1 --clock cpu` (CPU time of the one thread).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attention_micro import HEAD_DIM, build_decode_step  # noqa: E402
import native_guard  # noqa: E402

from pagedserve.attention.cpu_native import CpuNativeAttentionBackend, paged_decode_attention  # noqa: E402
from pagedserve.attention.kv_quantization import (  # noqa: E402
    Int8KVPageLayout,
    allocate_int8_kv_cache,
    write_to_int8_kv_cache,
)
from pagedserve.attention.torch_paged import TorchPagedAttentionBackend  # noqa: E402


def time_calls(functions: dict[str, Callable[[], object]], repeats: int,
               clock: Callable[[], float]) -> dict[str, tuple[float, float]]:
    """(min, median) milliseconds per function, calls interleaved round-robin so that load from other
    processes hits every variant alike."""
    for function in functions.values():
        function()  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            start = clock()
            function()
            samples[name].append(clock() - start)
    return {name: (min(times) * 1e3, statistics.median(times) * 1e3) for name, times in samples.items()}


def compare(seq_lens: list[int], dtype: torch.dtype, repeats: int, label: str,
            clock: Callable[[], float]) -> None:
    torch.manual_seed(0)  # build_decode_step draws from the global generator
    query, key, value, kv_cache, metadata = build_decode_step(seq_lens, dtype)
    scale = HEAD_DIM ** -0.5
    native, portable = CpuNativeAttentionBackend(), TorchPagedAttentionBackend()
    error = (native.forward(query, key, value, kv_cache, metadata, scale).float()
             - portable.forward(query, key, value, kv_cache, metadata, scale).float()).abs().max().item()
    results = time_calls({
        "torch_paged": lambda: portable.forward(query, key, value, kv_cache, metadata, scale),
        "cpu_native": lambda: native.forward(query, key, value, kv_cache, metadata, scale),
        "kernel alone": lambda: paged_decode_attention(query, kv_cache, metadata.block_table, metadata.seq_lens,
                                                       scale),
    }, repeats, clock)
    print(f"\n{label}, {dtype}: contexts {min(seq_lens)}-{max(seq_lens)} (sum {sum(seq_lens)}), "
          f"max|native - torch_paged| {error:.1e}")
    for name, (best, median) in results.items():
        print(f"  {name:<13} min {best:8.3f}  median {median:8.3f} ms/layer   x30 (min) = {30 * best:7.1f} ms/step")
    print(f"  torch_paged / cpu_native (min): {results['torch_paged'][0] / results['cpu_native'][0]:.2f}x")


def compare_int8_cache(seq_lens: list[int], repeats: int, label: str, clock: Callable[[], float]) -> None:
    """The decode kernel alone: a bfloat16 cache vs the same cache quantized to int8 pages."""
    torch.manual_seed(0)
    query, _, _, bf16_cache, metadata = build_decode_step(seq_lens, torch.bfloat16)
    _, num_blocks, block_size, num_kv_heads, head_dim = bf16_cache.shape
    int8_cache = allocate_int8_kv_cache(num_blocks, Int8KVPageLayout(block_size, num_kv_heads, head_dim),
                                        lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    slots = torch.arange(num_blocks * block_size, dtype=torch.int64)
    flat = bf16_cache.reshape(2, num_blocks * block_size, num_kv_heads, head_dim)
    write_to_int8_kv_cache(flat[0], flat[1], int8_cache, slots)
    scale = HEAD_DIM ** -0.5
    results = time_calls({
        "bf16 cache": lambda: paged_decode_attention(query, bf16_cache, metadata.block_table, metadata.seq_lens,
                                                     scale),
        "int8 cache": lambda: paged_decode_attention(query, int8_cache, metadata.block_table, metadata.seq_lens,
                                                     scale),
    }, repeats, clock)
    error = (paged_decode_attention(query, int8_cache, metadata.block_table, metadata.seq_lens, scale).float()
             - paged_decode_attention(query, bf16_cache, metadata.block_table, metadata.seq_lens, scale).float())
    print(f"\n{label}, kernel alone, bfloat16 query: contexts {min(seq_lens)}-{max(seq_lens)} (sum {sum(seq_lens)}), "
          f"max|int8 - bf16| {error.abs().max().item():.1e}")
    for name, (best, median) in results.items():
        print(f"  {name:<13} min {best:8.3f}  median {median:8.3f} ms/layer")
    print(f"  int8 / bf16 (min): {results['int8 cache'][0] / results['bf16 cache'][0]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--long", type=int, default=4096, help="context of the single-request case (0: skip)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: elapsed time; cpu: the process's CPU time (steadier on a shared machine, "
                             "meaningful with --threads 1)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto",
                        help="int8: the kernel alone over a bfloat16 cache vs its int8 quantization")
    args = parser.parse_args()
    native_guard.require_native_kernels(can_time_fallback=False)  # times native ops: no fallback to time
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"torch {torch.__version__}, {args.threads} threads, {args.clock} clock")
    rng = random.Random(1)
    # Same contexts as attention_micro.py: prompt (64-512) + tokens generated so far (0..64-256).
    seq_lens = [rng.randint(64, 512) + rng.randint(0, rng.randint(64, 256)) + 1 for _ in range(args.num_requests)]
    if args.kv_cache_dtype == "int8":
        compare_int8_cache(seq_lens, args.repeats, f"decode, {args.num_requests} requests", clock)
        if args.long:
            compare_int8_cache([args.long], args.repeats, "decode, 1 request", clock)
        return
    for dtype in (torch.bfloat16, torch.float32):
        compare(seq_lens, dtype, args.repeats, f"decode, {args.num_requests} requests", clock)
    if args.long:
        for dtype in (torch.bfloat16, torch.float32):
            compare([args.long], dtype, args.repeats, "decode, 1 request", clock)


if __name__ == "__main__":
    main()
