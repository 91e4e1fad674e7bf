"""weight_layout='amx_packed': bfloat16 linears on a native tile kernel, the weight in its tile-blocked layout.

A decode step streams every weight once, so its linears run at the bandwidth their loop sustains. oneDNN's packed
bf16 GEMM ('prepacked') sustained 17-19 GB/s at M = 1..16 with the weights in DRAM on an Intel Sapphire Rapids VM;
the native kernel (kernels/cpu/amx_linear.cpp) on AMX tiles sustained 25-28 GB/s, 1.4-1.5x, flat up to 16 rows,
1.3-1.4x at 32 and 1.05-1.2x at 64 (benchmarks/amx_linear.py). Prefill-sized batches run on the same kernel:
1.1-1.2x oneDNN at 128-512 rows, 0.75-0.85x at 2048.

Without AMX the same layout runs on AVX512-BF16 dot products (VDPBF16PS), and on CPUs without bf16 instructions on
fp32 FMA with the weights widened in registers: 16 lanes on AVX-512 (Skylake-SP, Cascade Lake, Ice Lake server), 8
on AVX2 (`amx_linear_products()` lists the units here; docs/cpu-isa.md which runs at which ISA level). Over SmolLM2-135M's 30 layers of linears on an AMD Zen 4 VM, against oneDNN's packed GEMM interleaved:
1.36-1.42x at one row (23-24 against 17 GB/s), 1.1-1.15x at 4-64 rows, 1.05x at 256 and 0.98x at 2048; recipe A
in bf16 ran 1.05x faster end to end than with 'prepacked', and batch-1 decode 1.33-1.4x. A one-row product then
streams six stretches of a thread's share at once, block by block and interleaved line by line (three stretches
each read 4 KiB at a time: 1.11-1.16x on a decode step's weights, batch-1 decode 78.7 -> 100-125 tok/s on that VM;
six interleaved: 1.14x more).

The packed weight *replaces* the plain one (one copy in memory), as a 1-D tensor of whole 16-column x 32-deep
tiles (zero padded); `restore_plain_layout` unpacks it bit for bit. A tied LM head, whose plain table the
embedding still reads, gets a packed copy in `packed_weight` (56 MB for SmolLM2-135M), as under 'prepacked'.

Numerics: one output is TDPBF16PS (or VDPBF16PS, or one fp32 FMA chain on the FMA units) over K in order into fp32,
+ bias, rounded to bf16 once. A row's result depends only on K and the weight: batch and thread invariant, not
bitwise equal to oneDNN's GEMM; tests compare both with a float64 reference and the engine's greedy tokens with the
plain layout's. The two FMA units give the same bits (the same chain and rounding).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedserve.kernels.cpu_library import load_native_op
from pagedserve.layers.linear import LinearMethodBase, packed_weight_of

AMX_PACKED_LAYOUT = "amx_packed"

# None: not checked yet; then whether the kernel is built and loaded with a unit this process can run.
_available: bool | None = None
_linear_op: Any = None


def amx_linear_available() -> bool:
    """True when the native library is loaded (building it at first use) with a product unit this process can
    run: every native build has one (AMX where compiled in and Linux granted the tile state, AVX512-BF16, AVX-512 or
    AVX2 FMA)."""
    global _available, _linear_op
    if _available is None:
        _linear_op = load_native_op("amx_linear", "is_amx_linear_supported", _amx_linear_fake)
        _available = _linear_op is not None
    return _available


def _amx_linear_fake(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int,
                     products: str = "auto") -> torch.Tensor:
    return x.new_empty((x.shape[0], n))


def load_amx_op(op_name: str, fake: Callable[..., Any]) -> Any:
    """pagedserve::<op_name>, another op of kernels/cpu/amx_linear.cpp (with `fake` for tracing), when
    `amx_linear_available()`; else None."""
    return load_native_op(op_name, "is_amx_linear_supported", fake) if amx_linear_available() else None


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """The [N, K] bfloat16 weight in the kernel's tile-blocked layout (1-D, zero padded to whole tiles)."""
    return torch.ops.pagedserve.amx_pack_weight(weight.detach())


def amx_unpack(packed: torch.Tensor, output_size: int, input_size: int) -> torch.Tensor:
    """The plain [output_size, input_size] weight back from `amx_pack`'s layout, bit for bit."""
    return torch.ops.pagedserve.amx_unpack_weight(packed.detach(), output_size, input_size)


def amx_linear_products() -> list[str]:
    """The product units the kernel can run here, preferred first: 'amx' (AMX tiles, where the CPU has them and
    Linux grants the tile state) and 'avx512_bf16' (VDPBF16PS dot products) in an AVX512-BF16 build, 'avx512'
    (16-lane fp32 FMA) in the avx512 level's, 'avx2' (8-lane fp32 FMA) in an AVX2 build; [] without the native
    kernels."""
    return list(torch.ops.pagedserve.amx_linear_products()) if amx_linear_available() else []


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, output_size: int,
               products: str = "auto") -> torch.Tensor:
    """x @ W^T + b for bfloat16 x [..., K] on the CPU and W packed by `amx_pack`; `products` picks the unit
    ('auto': the first of `amx_linear_products()`)."""
    if x.dim() == 2 and x.stride(1) == 1:  # the model's case: [num_tokens, K]; skips ~4 us of reshapes per call
        return _linear_op(x, packed, bias, output_size, products)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return _linear_op(rows, packed, bias, output_size, products).view(*x.shape[:-1], output_size)


class AmxPackedLinearMethod(LinearMethodBase):
    """CPU, bfloat16: the weight lives in the native kernel's tile-blocked layout; every batch runs on the kernel."""

    layout = AMX_PACKED_LAYOUT

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Replace the plain weight by its packed form (linear layers and untied LM heads)."""
        if layer.weight.dim() == 1:
            return  # already packed
        # Replacing the Parameter frees the plain tensor: one copy of the weights stays in memory.
        layer.weight = nn.Parameter(amx_pack(layer.weight), requires_grad=False)

    def plain_weight(self, layer: nn.Module) -> torch.Tensor:
        """The layer's weight unpacked to [output_size_per_partition, input_size_per_partition]."""
        return amx_unpack(layer.weight, layer.output_size_per_partition, layer.input_size_per_partition)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return amx_linear(x, packed_weight_of(layer), bias, layer.output_size_per_partition)


AMX_PACKED_LINEAR_METHOD = AmxPackedLinearMethod()

__all__ = ["AMX_PACKED_LAYOUT", "AMX_PACKED_LINEAR_METHOD", "AmxPackedLinearMethod", "amx_linear",
           "amx_linear_available", "amx_linear_products", "amx_pack", "amx_unpack", "load_amx_op"]
