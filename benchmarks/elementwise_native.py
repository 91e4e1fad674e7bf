"""Micro-benchmark: the native fused elementwise kernels (kernels/cpu/elementwise.cpp) vs forward_native.

Per decoder layer of the SmolLM2-135M-shaped benchmark model (hidden 576, 9 heads / 3 KV heads, head_dim 64,
intermediate 1536), the elementwise work around the GEMMs and attention: the input residual add + RMSNorm, RoPE
on the query/key slices of a fused qkv output, the post-attention residual add + RMSNorm and SiLU-and-mul of
the fused gate/up output. 30 such layers per call (the model's depth), each layer's modules called the way
the model calls them, once through the native kernels (forward_cpu) and once through forward_native.

Usage: python benchmarks/elementwise_native.py [--threads 2] [--repeats 30] [--layers 30] [--clock wall|cpu]
Prints min and median ms per 30 layers for batch 1 and 64 tokens, float32 and bfloat16, and the
native speed-up (forward_native / native). On a shared, oversubscribed machine use `--threads 1 --clock cpu`.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pagedserve.kernels import elementwise as native_elementwise  # noqa: E402
from pagedserve.layers.activation import SiluAndMul  # noqa: E402
from pagedserve.layers.norm import RMSNorm  # noqa: E402
from pagedserve.layers.rotary import get_rope  # noqa: E402
from attention_native import time_calls  # noqa: E402  (interleaved min/median timing)
import native_guard  # noqa: E402

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE = 576, 9, 3, 64, 1536


def layers_call(num_tokens: int, dtype: torch.dtype, num_layers: int, native: bool) -> Callable[[], object]:
    """One call = `num_layers` layers' elementwise ops on fixed inputs (the GEMM outputs are stand-ins)."""
    generator = torch.Generator().manual_seed(0)
    rope = get_rope(HEAD_DIM, 8192, {"rope_type": "default", "rope_theta": 100000.0})
    input_norm, post_norm = RMSNorm(HIDDEN, 1e-5, params_dtype=dtype), RMSNorm(HIDDEN, 1e-5, params_dtype=dtype)
    activation = SiluAndMul()
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    hidden = torch.randn(num_tokens, HIDDEN, generator=generator).to(dtype)
    attention_out = torch.randn(num_tokens, HIDDEN, generator=generator).to(dtype)
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=generator).to(dtype)
    gate_up = torch.randn(num_tokens, 2 * INTERMEDIATE, generator=generator).to(dtype)
    positions = torch.randint(0, 1024, (num_tokens,), generator=generator)
    norm_in = input_norm.forward_cpu if native else input_norm.forward_native
    norm_post = post_norm.forward_cpu if native else post_norm.forward_native
    rotate = rope.forward_cpu if native else rope.forward_native
    act = activation.forward_cpu if native else activation.forward_native

    def call() -> object:
        rope.clear_memo()  # as the model does once per forward
        residual = hidden
        for _ in range(num_layers):
            normed, residual = norm_in(hidden, residual)
            query, key, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
            query, key = rotate(positions, query, key)
            normed, residual = norm_post(attention_out, residual)
            out = act(gate_up)
        return out, normed, query

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    native_guard.require_native_kernels(can_time_fallback=False)  # times native ops: no fallback to time
    if args.threads:
        torch.set_num_threads(args.threads)
    if not native_elementwise.native_elementwise_available():
        sys.exit("the native kernels are unavailable (see the warning above)")
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"threads={torch.get_num_threads()} clock={args.clock} layers={args.layers} repeats={args.repeats}")
    print(f"{'dtype':>9} {'tokens':>6} {'native min/med ms':>18} {'forward_native min/med ms':>26} {'speed-up':>8}")
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            for num_tokens in (1, 64):
                results = time_calls({
                    "native": layers_call(num_tokens, dtype, args.layers, native=True),
                    "forward_native": layers_call(num_tokens, dtype, args.layers, native=False),
                }, args.repeats, clock)
                (native_min, native_median), (plain_min, plain_median) = results["native"], results["forward_native"]
                print(f"{str(dtype).split('.')[-1]:>9} {num_tokens:>6} {native_min:>8.2f} / {native_median:<8.2f}"
                      f" {plain_min:>12.2f} / {plain_median:<11.2f} {plain_min / native_min:>7.2f}x")


if __name__ == "__main__":
    main()
