"""AddRMSNormQuantFusionPass: residual add + RMSNorm -> pagedserve::fused_add_rms_norm.

Matches the op sequence of `RMSNorm.forward_native(x, residual)` (layers/norm.py) and returns
`(normed, x + residual)` from one fused op.

Quantisation hook: vllm-ascend's pass also folds a static or dynamic activation quantisation that
consumes the norm output into the same kernel. No quantised model exists here yet, so the quant part is
not fused: `quant_consumer` is the seam (it returns None: no quant step recognised) where a quant
method registers its quantise op, at which point the pass would match norm + quant and emit a fused
norm-quant op returning `(quantised, scale, residual)`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import fx

from pagedserve.compilation import fused_operators  # noqa: F401  (registers torch.ops.pagedserve.*)
from pagedserve.compilation.fusion_pass import FusionPass, cast_back, cast_back_dtypes, rms_norm_eps_values


class AddRMSNormQuantFusionPass(FusionPass):
    name = "fuse_norm_quant"

    def candidate_parameters(self, graph: fx.Graph) -> Iterable[tuple[Any, ...]]:
        for eps in rms_norm_eps_values(graph):
            for dtype in cast_back_dtypes(graph):
                yield eps, dtype

    def pattern(self, eps: float, dtype: torch.dtype | None) -> Callable[..., Any]:
        def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> Any:
            x = x + residual
            residual = x
            hidden = x.to(torch.float32)
            variance = hidden.pow(2).mean(dim=-1, keepdim=True)
            hidden = hidden * torch.rsqrt(variance + eps)
            output = weight * cast_back(hidden, x, dtype)
            return output, residual

        return add_rms_norm

    def replacement(self, eps: float, dtype: torch.dtype | None) -> Callable[..., Any]:
        def fused(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> Any:
            result = torch.ops.pagedserve.fused_add_rms_norm.default(x, residual, weight, eps)
            return result[0], result[1]

        return fused

    def quant_consumer(self, norm_output: fx.Node) -> fx.Node | None:
        """The quantise node consuming a fused norm's output, once quantised models exist (None today)."""
        return None


__all__ = ["AddRMSNormQuantFusionPass"]
