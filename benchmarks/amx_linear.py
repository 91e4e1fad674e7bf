"""The native AMX bfloat16 linear (weight_layout='amx_packed') against oneDNN's packed GEMM ('prepacked').

SmolLM2-135M's four linear shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536). At decode batch sizes
90 layers of them (637 MB of bf16 weights, twice this machine's L3, so every call streams its weight from DRAM,
as in a real decode step), reported as the weight bytes streamed per second; at prefill sizes 8 layers, reported
as TFLOPS. Both implementations run interleaved, best of --repeats.

    python benchmarks/amx_linear.py
"""
from __future__ import annotations

import argparse
import time

import torch

from pagedserve.layers.amx_linear import amx_linear, amx_linear_available, amx_pack
from pagedserve.layers.prepacked_matmul import prepacked_matmul

import native_guard

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def measure(num_layers: int, rows: list[int], repeats: int) -> dict[tuple[int, str], float]:
    """Best seconds per pass over all layers, for each (rows, 'onednn' | 'amx')."""
    generator = torch.Generator().manual_seed(0)
    plain = [[(torch.randn(n, k, generator=generator) / k ** 0.5).to(torch.bfloat16) for n, k in SHAPES]
             for _ in range(num_layers)]
    packed = {"onednn": [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in layer] for layer in plain],
              "amx": [[amx_pack(w) for w in layer] for layer in plain]}
    del plain
    inputs = {m: {k: torch.randn(m, k, generator=generator).to(torch.bfloat16) for _, k in SHAPES} for m in rows}

    def run(m: int, kind: str) -> float:
        x = inputs[m]
        linear = prepacked_matmul if kind == "onednn" else amx_linear
        start = time.perf_counter()
        for layer in packed[kind]:
            for weight, (n, k) in zip(layer, SHAPES):
                linear(x[k], weight, None, n)
        return time.perf_counter() - start

    best = {(m, kind): float("inf") for m in rows for kind in packed}
    for _ in range(repeats):
        for m in rows:
            for kind in packed:
                best[(m, kind)] = min(best[(m, kind)], run(m, kind))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode-rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--prefill-rows", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    native_guard.require_native_kernels(can_time_fallback=False)  # times native ops: no fallback to time
    if not amx_linear_available():
        raise SystemExit("the native AMX kernel is not available on this machine")
    torch.set_num_threads(args.threads)
    weights_per_layer = sum(n * k for n, k in SHAPES)

    decode_layers = 90
    best = measure(decode_layers, args.decode_rows, args.repeats)
    num_bytes = weights_per_layer * 2 * decode_layers
    print(f"decode sizes: {decode_layers} layers, {num_bytes / 1e6:.0f} MB of bf16 weights, {args.threads} threads; "
          f"GB/s of weight streamed (best of {args.repeats})")
    print(f"{'rows':>5} {'oneDNN':>7} {'AMX':>6} {'ratio':>6}")
    for m in args.decode_rows:
        onednn, amx = num_bytes / best[(m, 'onednn')] / 1e9, num_bytes / best[(m, 'amx')] / 1e9
        print(f"{m:>5} {onednn:7.1f} {amx:6.1f} {amx / onednn:5.2f}x")

    prefill_layers = 8
    best = measure(prefill_layers, args.prefill_rows, args.repeats)
    print(f"prefill sizes: {prefill_layers} layers; TFLOPS (best of {args.repeats})")
    print(f"{'rows':>5} {'oneDNN':>7} {'AMX':>6} {'ratio':>6}")
    for m in args.prefill_rows:
        flops = 2 * m * weights_per_layer * prefill_layers
        onednn, amx = flops / best[(m, 'onednn')] / 1e12, flops / best[(m, 'amx')] / 1e12
        print(f"{m:>5} {onednn:7.2f} {amx:6.2f} {amx / onednn:5.2f}x")


if __name__ == "__main__":
    main()
