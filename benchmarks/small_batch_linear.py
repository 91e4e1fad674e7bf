"""The native small-batch float32 linear (weight_layout='plain_native') against F.linear (MKL's sgemm).

SmolLM2-135M's four linear shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536), 45 layers of them
(637 MB of float32 weights, twice this machine's L3, so every call streams its weight from DRAM, as in a real
decode step), at decode batch sizes. Both implementations run interleaved, best of --repeats; reported as the
weight bytes streamed per second.

    python benchmarks/small_batch_linear.py
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pagedserve.layers.small_batch_linear import MAX_ROWS, small_batch_linear, small_batch_linear_available

import native_guard

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=45)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    native_guard.require_native_kernels(can_time_fallback=False)  # times native ops: no fallback to time
    if not small_batch_linear_available():
        raise SystemExit("the native small-batch kernel is not available on this machine")
    if max(args.rows) > MAX_ROWS:
        raise SystemExit(f"--rows must be <= {MAX_ROWS}")
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=generator) / k ** 0.5 for n, k in SHAPES] for _ in range(args.layers)]
    inputs = {m: {k: torch.randn(m, k, generator=generator) for _, k in SHAPES} for m in args.rows}
    num_bytes = sum(n * k * 4 for n, k in SHAPES) * args.layers

    def run(m: int, native: bool) -> float:
        x = inputs[m]
        start = time.perf_counter()
        for layer in weights:
            for weight in layer:
                xi = x[weight.shape[1]]
                if native:
                    small_batch_linear(xi, weight, None)
                else:
                    F.linear(xi, weight)
        return time.perf_counter() - start

    best = {(m, native): float("inf") for m in args.rows for native in (False, True)}
    for _ in range(args.repeats):
        for m in args.rows:
            for native in (False, True):
                best[(m, native)] = min(best[(m, native)], run(m, native))
    print(f"{args.layers} layers, {num_bytes / 1e6:.0f} MB of float32 weights, {args.threads} threads; GB/s of weight "
          f"streamed (best of {args.repeats})")
    print(f"{'rows':>4} {'F.linear':>9} {'native':>7} {'ratio':>6}")
    for m in args.rows:
        mkl, native = num_bytes / best[(m, False)] / 1e9, num_bytes / best[(m, True)] / 1e9
        print(f"{m:>4} {mkl:9.1f} {native:7.1f} {native / mkl:5.2f}x")


if __name__ == "__main__":
    main()
