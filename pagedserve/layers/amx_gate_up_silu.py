"""The MLP's gate_up projection and SiLU-and-mul in one native pass, for prefill-sized batches on the tile layout.

With weight_layout='amx_packed' a bfloat16 MLP computes gate_up = x @ W^T ([M, 2d]), writes it out, and the
SiLU-and-mul kernel reads it back to produce silu(gate) * up ([M, d]). Above 256 rows `amx_linear_silu_and_mul`
(kernels/cpu/amx_linear.cpp) computes each 32-row chunk's gate and up columns into L1 and writes only the
[M, d] result, bitwise what the two kernels give (same sums, same roundings, the same SiLU table). Interleaved
with the unfused pair over 30 layers of SmolLM2-135M's gate_up at 2048 rows: 1.17x.

`LlamaMLP.forward` asks `fused_gate_up_silu_and_mul` first; it answers None (the modules run as before) for
decode-sized batches, other layouts or activations, hooks on the two modules, torch.compile tracing, and shapes
the kernel does not take (d not a multiple of 64, K not of 32).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.kernels import elementwise as native_elementwise
from pagedserve.layers.activation import SiluAndMul
from pagedserve.layers.amx_linear import AmxPackedLinearMethod, load_amx_op
from pagedserve.layers.forward_hooks import has_forward_hooks, hook_registries
from pagedserve.layers.linear import packed_weight_of

# Up to this many rows the unfused pair runs: amx_linear's one-chunk path streams decode-sized batches' weights
# with prefetching, which the fused (paneled) loop does not do.
MIN_FUSED_ROWS = 257
GROUP_COLUMNS = 64  # the kernel's output columns per weight group: d must be a multiple
STEP_DEPTH = 32  # the kernel's K per tile step: K must be a multiple

_op: Any = None
_checked = False


def _fused_fake(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int,
                products: str = "auto") -> torch.Tensor:
    return x.new_empty((x.shape[0], n // 2))


def fused_op_available() -> bool:
    """Whether the native library has the fused op and a product unit this process can run (every native build
    has one: layers/amx_linear.py `amx_linear_products`; loaded at first call)."""
    global _op, _checked
    if not _checked:
        _op = load_amx_op("amx_linear_silu_and_mul", _fused_fake)
        _checked = True
    return _op is not None


def amx_linear_silu_and_mul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                            output_size: int, products: str = "auto") -> torch.Tensor:
    """silu(gate) * up for [gate | up] = x @ W^T + b, x bfloat16 [M, K] and W [output_size, K] packed by
    `amx_pack`; [M, output_size // 2], on the product unit `products` names (layers/amx_linear.py
    `amx_linear_products`). Requires `fused_op_available()`."""
    return _op(x, packed, bias, output_size, products)


def fused_gate_up_silu_and_mul(gate_up_proj: nn.Module, act_fn: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """act_fn(gate_up_proj(x)) in one pass when that is bitwise the same and pays (see the module docstring);
    None when the modules should run."""
    if x.dim() != 2 or x.shape[0] < MIN_FUSED_ROWS:
        return None  # first: decode steps leave after one comparison
    if type(gate_up_proj.linear_method) is not AmxPackedLinearMethod or getattr(gate_up_proj, "gather_output", False):
        return None
    # The unfused activation must be the native kernel (whose SiLU table the fused op shares).
    if type(act_fn) is not SiluAndMul or act_fn._forward_method != act_fn.forward_cpu \
            or not native_elementwise.qualifies(x) or x.dtype != torch.bfloat16:
        return None
    output_size = gate_up_proj.output_size_per_partition
    if output_size % (2 * GROUP_COLUMNS) or gate_up_proj.input_size_per_partition % STEP_DEPTH or x.stride(-1) != 1:
        return None
    if has_forward_hooks(hook_registries((gate_up_proj, act_fn))) or not fused_op_available():
        return None
    return _op(x, packed_weight_of(gate_up_proj), gate_up_proj.bias, output_size)


__all__ = ["MIN_FUSED_ROWS", "amx_linear_silu_and_mul", "fused_gate_up_silu_and_mul", "fused_op_available"]
