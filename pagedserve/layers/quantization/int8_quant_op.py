"""`pagedserve::quantize_per_token_int8`: per-token dynamic int8 quantization as one graph node.

Eager W8A8 layers call `quantize_per_token` directly (a custom op's dispatch would cost ~10 us a call); a traced
graph (torch.compile / Dynamo) records this op instead, so the norm+quant fusion pass
(compilation/add_rms_norm_fusion.py) can find the quantization that consumes an RMSNorm's output and fold it
into the norm's epilogue. Same math, same bits, either way.
"""
from __future__ import annotations

import torch
from torch.library import custom_op, register_fake

from pagedserve.layers.quantization.int8_matmul import quantize_per_token


@custom_op("pagedserve::quantize_per_token_int8", mutates_args=())
def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_per_token(x)


@register_fake("pagedserve::quantize_per_token_int8")
def _quantize_per_token_int8_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(x, dtype=torch.int8),
            x.new_empty((*x.shape[:-1], 1), dtype=torch.float32))


def is_tracing() -> bool:
    """Whether the caller is being traced into a graph (Dynamo or torch.fx), where the op form is wanted."""
    return torch.compiler.is_compiling() or torch.fx._symbolic_trace.is_fx_symbolic_tracing()


def quantize_per_token_traceable(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_per_token(x); the custom op while tracing (see the module docstring)."""
    if is_tracing():
        return torch.ops.pagedserve.quantize_per_token_int8.default(x)
    return quantize_per_token(x)


__all__ = ["is_tracing", "quantize_per_token_int8", "quantize_per_token_traceable"]
