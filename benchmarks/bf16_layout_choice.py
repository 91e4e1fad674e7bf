"""Which bfloat16 weight layout `weight_layout='auto'` should take at this ISA level: the tile-packed native kernel
('amx_packed', on the product unit the loaded build runs first) against oneDNN's packed GEMM ('prepacked').

SmolLM2-135M's linear shapes [N, K] (576x576: q and o; 1536x576: gate and up; 576x1536: down; 49152x576: the LM
head) at decode and small-prefill row counts. Each shape is cycled through enough copies of its weight (--megabytes
per layout) that every call streams its weight from DRAM, as in a real decode step (L3 here: 300 MiB). The two
layouts run interleaved (their order alternating by round, since other processes share the CPU); the report is the
median over --rounds of each one's weight bytes streamed per second and of the per-round ratio.

At the avx512 level (AVX-512 without BF16, as on Skylake-SP / Cascade Lake), emulated on a newer CPU:

    PAGEDSERVE_CPU_ISA=avx512 ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE \\
        PYTHONPATH=. python benchmarks/bf16_layout_choice.py

(ONEDNN_MAX_CPU_ISA keeps oneDNN off the AVX512-BF16 and AMX instructions such a CPU lacks.) On a machine other
processes load, `--threads 1`: with two threads each call waits at its join for a descheduled thread.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from pagedserve.kernels import cpu_isa
from pagedserve.layers.amx_linear import amx_linear, amx_linear_available, amx_linear_products, amx_pack
from pagedserve.layers.prepacked_matmul import prepacked_matmul
from pagedserve.layers.weight_layout import can_prepack_on_cpu

import native_guard

SHAPES = ((576, 576), (1536, 576), (576, 1536), (49152, 576))
LAYOUTS = ("amx_packed", "prepacked")


def copies_of(n: int, k: int, megabytes: int, generator: torch.Generator) -> dict[str, list[torch.Tensor]]:
    """Each layout's copies of one [n, k] weight (distinct random values), `megabytes` of bf16 in all."""
    num_copies = max(1, megabytes * 2 ** 20 // (n * k * 2))
    packed: dict[str, list[torch.Tensor]] = {layout: [] for layout in LAYOUTS}
    for _ in range(num_copies):
        weight = (torch.randn(n, k, generator=generator) / k ** 0.5).to(torch.bfloat16)
        packed["amx_packed"].append(amx_pack(weight))
        packed["prepacked"].append(torch.ops.mkldnn._reorder_linear_weight(weight, None))
    return packed


def one_pass(layout: str, weights: list[torch.Tensor], x: torch.Tensor, n: int) -> float:
    """Seconds for one call per copy."""
    linear = amx_linear if layout == "amx_packed" else prepacked_matmul
    start = time.perf_counter()
    for weight in weights:
        linear(x, weight, None, n)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--megabytes", type=int, default=320, help="weight bytes per shape and layout")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads (1 keeps a loaded machine's scheduler out of every call's thread join)")
    args = parser.parse_args()
    native_guard.require_native_kernels(can_time_fallback=False)  # times native ops: no fallback to time
    torch.set_num_threads(args.threads)
    if not amx_linear_available() or not can_prepack_on_cpu(torch.bfloat16):
        raise SystemExit(f"needs both layouts in bfloat16 (amx_packed units: {amx_linear_products()}, "
                         f"prepacked: {can_prepack_on_cpu(torch.bfloat16)})")
    print(f"ISA level {cpu_isa.describe()}; amx_packed unit {amx_linear_products()[0]!r}; "
          f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '(unset)')}; {torch.get_num_threads()} threads; "
          f"median of {args.rounds} interleaved rounds")
    print("| shape [N x K] | rows | amx_packed GB/s | prepacked GB/s | amx_packed / prepacked |")
    print("|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        packed = copies_of(n, k, args.megabytes, generator)
        num_bytes = len(packed["amx_packed"]) * n * k * 2
        for m in args.rows:
            x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
            for layout in LAYOUTS:  # warm-up: first-call costs (oneDNN primitive creation) stay out of the rounds
                one_pass(layout, packed[layout][:2], x, n)
            seconds: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
            ratios = []
            for round_index in range(args.rounds):
                order = LAYOUTS if round_index % 2 == 0 else LAYOUTS[::-1]
                for layout in order:
                    seconds[layout].append(one_pass(layout, packed[layout], x, n))
                ratios.append(seconds["prepacked"][-1] / seconds["amx_packed"][-1])
            rates = {layout: num_bytes / statistics.median(seconds[layout]) / 1e9 for layout in LAYOUTS}
            print(f"| {n} x {k} | {m} | {rates['amx_packed']:.1f} | {rates['prepacked']:.1f} | "
                  f"{statistics.median(ratios):.2f}x |", flush=True)
        del packed


if __name__ == "__main__":
    main()
