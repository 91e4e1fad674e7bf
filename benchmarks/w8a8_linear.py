"""The native W8A8 int8 linear (`w8a8_linear`) per product unit against the bfloat16 AMX linear, per op.

SmolLM2-135M's four linear shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536), bf16 activations
quantized per token inside the op. At decode row counts (1, 16) 30 layers of them, as in one decode step of the
model (its int8 weights, 80 MB, stream from beyond L2 each pass); at prefill row counts (512) 4 layers. Each
int8 unit this build runs (`w8a8_linear_products()`: amx, avx512_vnni, int16) and 'auto' (what the layers take)
are timed interleaved with bf16 `amx_linear` (weight_layout='amx_packed', this CPU's bf16 path), best of --repeats;
reported: microseconds per pass over the layers and bf16 time / int8 time.

    PYTHONPATH=. python benchmarks/w8a8_linear.py [--rows 1 16 512] [--repeats 20] [--cpu-time]

--cpu-time: one thread, timed by the thread's CPU time (time.thread_time) instead of the wall clock: the kernels'
own cost, much less moved by other jobs on a shared machine (their cache and memory traffic still count).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from pagedserve.layers.amx_linear import amx_linear, amx_linear_available, amx_pack
from pagedserve.layers.quantization.int8_matmul import native_w8a8_linear

import native_guard

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
DECODE_LAYERS, PREFILL_LAYERS = 30, 4


def measure(rows: int, repeats: int, clock=time.perf_counter) -> dict[str, float]:
    """Best seconds per pass over the layers for 'bf16' and each int8 unit."""
    num_layers = DECODE_LAYERS if rows <= 64 else PREFILL_LAYERS
    generator = torch.Generator().manual_seed(0)
    int8_layers, bf16_layers = [], []
    for _ in range(num_layers):
        for n, k in SHAPES:
            weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
            scale = torch.rand(n, generator=generator) * 0.01 + 1e-4
            int8_layers.append((weight, scale))
            bf16_layers.append((amx_pack((weight.float() * scale[:, None]).to(torch.bfloat16)), n, k))
    inputs = {k: torch.randn(rows, k, generator=generator).to(torch.bfloat16) for _, k in SHAPES}
    kernel = native_w8a8_linear()
    units = ["auto", *torch.ops.pagedserve.w8a8_linear_products()]

    def run(kind: str) -> float:
        start = clock()
        if kind == "bf16":
            for packed, n, k in bf16_layers:
                amx_linear(inputs[k], packed, None, n)
        else:
            for weight, scale in int8_layers:
                kernel(inputs[weight.shape[1]], weight, scale, None, None, None, kind)
        return clock() - start

    kinds = ["bf16", *units]
    best = {kind: float("inf") for kind in kinds}
    for _ in range(repeats):
        for kind in kinds:
            best[kind] = min(best[kind], run(kind))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 512])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cpu-time", action="store_true", help="one thread, its CPU time (see above)")
    args = parser.parse_args()
    native_guard.require_native_kernels(can_time_fallback=False)  # times native ops: no fallback to time
    clock = time.perf_counter
    if args.cpu_time:
        torch.set_num_threads(1)
        clock = time.thread_time
    if native_w8a8_linear() is None or not amx_linear_available():
        raise SystemExit("needs the native library with w8a8_linear and amx_linear")
    clock_name = " (CPU time)" if args.cpu_time else ""
    print(f"threads {torch.get_num_threads()}{clock_name}, load average {os.getloadavg()[0]:.2f}, int8 units "
          f"{', '.join(torch.ops.pagedserve.w8a8_linear_products())}")
    for rows in args.rows:
        best = measure(rows, args.repeats, clock)
        cells = ", ".join(f"{kind} {seconds * 1e6:.0f} us ({best['bf16'] / seconds:.2f}x)"
                          for kind, seconds in best.items() if kind != "bf16")
        print(f"{rows} rows: bf16 {best['bf16'] * 1e6:.0f} us; int8 {cells}")


if __name__ == "__main__":
    main()
