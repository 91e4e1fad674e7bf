"""The GEMM on a weight in oneDNN's packed layout (weight_layout='prepacked': linear layers, LM head).

Under torch.compile the packed GEMM is the opaque custom op `pagedserve::prepacked_linear` (inductor's
own lowering of `mkldnn._linear_pointwise` requires frozen constant weights); eager calls the ATen op
directly, which saves the custom-op dispatch on every call.
"""
from __future__ import annotations

import torch


@torch.library.custom_op("pagedserve::prepacked_linear", mutates_args=())
def prepacked_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                     output_size: int) -> torch.Tensor:
    """x @ W^T + b with W in oneDNN's packed layout (the traceable form of the eager call)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@prepacked_linear.register_fake
def _prepacked_linear_fake(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                           output_size: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], output_size))


def prepacked_matmul(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                     output_size: int) -> torch.Tensor:
    """x @ W^T + b for a weight packed by `mkldnn._reorder_linear_weight` (linear layers and the LM head)."""
    if torch.compiler.is_compiling():
        return torch.ops.pagedserve.prepacked_linear(x, packed_weight, bias, output_size)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


__all__ = ["prepacked_matmul"]
