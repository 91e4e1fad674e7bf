"""The kept-quantized GGUF linear kernel (kernels/cpu/gguf_linear.cpp) on the default model's own tensors, by rows.

Every product of one SmolLM2-135M-Instruct decode step on the embedded Q4_1 file (30 layers x qkv 960x576,
o 576x576, gate_up 3072x576, down 576x1536 in Q4_1, and the tied Q8_0 LM head 49152x576), each called with M input
rows: a decode step's linear time at batch M (a 5-row call is a batch-1 ngram verification with K=4). Rounds
interleave the row counts; the best round of each is reported, as ms per step and as the ratio to M=1.

Each product unit of the build (`--products`, default every unit gguf_linear_products() lists: 'amx' where AMX-INT8
runs, 'vector') is timed on the same inputs, on each weight layout (`--layouts`): 'file' (the blocks as the file
holds them) and 'interleaved' (layers/gguf_linear.py interleave_weight, for the weights the loader interleaves on
this machine: `interleaves`; the others stay in the file's layout, as in the engine). A unit's rows past the vector
products' 64 are left out.

`--gguf FILE` times another file's decode step the same way (large_gguf.py's models, a Q4_K_M file): a fused
product whose parts hold different types is timed part by part, as the engine computes it, and on the amx unit the
products of a type it does not take (Q5_0, Q5_1, Q5_K, Q6_K) run on the vector unit (as 'auto' runs them up to 8
rows; the engine dequantizes them past that).

    python benchmarks/gguf_linear_rows.py [--rows 1 2 4 5 8 16 64 128] [--repeats 7] [--threads 1]
        [--products amx vector] [--layouts file interleaved] [--gguf FILE]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGUFReader

from pagedserve.kernels import cpu_isa
from pagedserve.layers.gguf_linear import (AMX_TYPES, KERNEL_TYPES, block_type, gguf_kernels_available,
                                           gguf_linear_products, interleave_weight, interleaves)
from pagedserve.model_loader.default_model import resolve_model_path

import native_guard

VECTOR_MAX_ROWS = 64  # the vector products' largest M (kernels/cpu/gguf_linear.cpp kMaxInputs)
# The per-layer tensors of one decode step (q, k and v are separate in the file; the engine fuses them).
LAYER_PARTS = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))


def step_weights(path: str) -> list[tuple[torch.Tensor, int, int]]:
    """(blocks [N, bytes per row], ggml type, K) of every product of a decode step, fused as the engine fuses them
    (part by part where the parts' types differ, as GGUFPartsLinearMethod computes them)."""
    tensors = {tensor.name: tensor for tensor in GGUFReader(path).tensors}
    num_layers = sum(1 for name in tensors if name.endswith(".attn_q.weight"))
    products = []
    for layer in range(num_layers):
        for parts in LAYER_PARTS:
            part_products = []
            for part in parts:
                tensor = tensors[f"blk.{layer}.{part}.weight"]
                rows, k = (int(d) for d in reversed(tensor.shape.tolist()))
                part_products.append((torch.from_numpy(np.array(tensor.data).view(np.uint8).reshape(rows, -1)),
                                      int(tensor.tensor_type), k))
            if len({ggml_type for _, ggml_type, _ in part_products}) == 1:
                products.append((torch.cat([blocks for blocks, _, _ in part_products]), *part_products[0][1:]))
            else:
                products += part_products
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    rows, k = (int(d) for d in reversed(head.shape.tolist()))
    products.append((torch.from_numpy(np.array(head.data).view(np.uint8).reshape(rows, -1)), int(head.tensor_type), k))
    return products


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 8])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--products", nargs="+", default=None, help="units to time (default: every unit of the build)")
    parser.add_argument("--layouts", nargs="+", default=["file", "interleaved"], choices=["file", "interleaved"])
    parser.add_argument("--gguf", default=None, help="a GGUF file to time instead of the default model's")
    args = parser.parse_args()
    native_guard.require_native_kernels(can_time_fallback=False)  # times native ops: no fallback to time
    if not gguf_kernels_available():
        raise SystemExit("the native GGUF kernels are not available on this machine")
    units = args.products or list(gguf_linear_products())
    torch.set_num_threads(args.threads)
    file_products = step_weights(args.gguf or resolve_model_path(None))
    other_types = sorted({KERNEL_TYPES[t] for _, t, _ in file_products if t not in AMX_TYPES})
    if "amx" in units and other_types:
        print(f"the amx unit does not take {', '.join(other_types)}: those products run on the vector unit in its rows")
    layouts = {"file": file_products,
               "interleaved": [(*interleave_weight(blocks, ggml_type), k) if interleaves(ggml_type, blocks.shape[0])
                               else (blocks, ggml_type, k) for blocks, ggml_type, k in file_products]}
    products = file_products
    linear = torch.ops.pagedserve.gguf_linear
    generator = torch.Generator().manual_seed(0)
    inputs = {m: {k: torch.randn(m, k, generator=generator) for k in {k for _, _, k in products}} for m in args.rows}

    def run(m: int, unit: str, layout: str) -> float:
        x = inputs[m]
        clock = time.thread_time if args.threads == 1 else time.perf_counter
        start = clock()
        for blocks, ggml_type, k in layouts[layout]:
            linear(x[k], blocks, ggml_type, None, unit if ggml_type in AMX_TYPES else "vector")
        return clock() - start

    cases = [(m, unit, layout) for m in args.rows for layout in args.layouts for unit in units
             if m <= VECTOR_MAX_ROWS or (unit == "amx" and not other_types)]
    for case in cases:
        run(*case)  # warm-up (and the library build)
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(args.repeats):
        for case in cases:
            best[case] = min(best[case], run(*case))
    num_bytes = sum(blocks.numel() for blocks, _, _ in products)
    types = sorted({KERNEL_TYPES[t] for _, t, _ in products})
    interleaved = sorted({KERNEL_TYPES[block_type(t)] for _, t, _ in layouts["interleaved"] if block_type(t) != t})
    print(f"ISA level {cpu_isa.describe()}; {len(products)} products ({', '.join(types)}; interleaved here: "
          f"{', '.join(interleaved) or 'none'}), {num_bytes / 1e6:.1f} MB of blocks, {args.threads} threads; "
          f"{'CPU' if args.threads == 1 else 'wall'} ms per decode step's products (best of {args.repeats}); "
          f"'vs 1 row': against the same unit and layout at {args.rows[0]} rows")
    print(f"{'rows':>4} {'layout':>11} {'unit':>7} {'ms':>8} {'vs 1 row':>8} {'GB/s':>6} {'ms/row':>7}")
    for m, unit, layout in cases:
        seconds = best[(m, unit, layout)]
        first = best.get((args.rows[0], unit, layout), float("nan"))
        print(f"{m:>4} {layout:>11} {unit:>7} {seconds * 1e3:8.2f} {seconds / first:7.2f}x "
              f"{num_bytes / seconds / 1e9:6.1f} {seconds * 1e3 / m:7.2f}")

if __name__ == "__main__":
    main()
