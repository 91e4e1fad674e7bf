"""AddRMSNormQuantFusionPass: residual add + RMSNorm (+ the W8A8 quantization consuming it) -> one op.

Stage 1 matches the op sequence of `RMSNorm.forward_native(x, residual)` (layers/norm.py) and returns
`(normed, x + residual)` from `pagedserve::fused_add_rms_norm`.

Stage 2 (vllm-ascend's add_rms_norm + dynamic_quant variant, algorithm note M10): where a fused norm's output
feeds only a per-token int8 quantization (`pagedserve::quantize_per_token_int8`, which a W8A8 dynamic linear
records when traced: layers/quantization/int8_quant_op.py), the pair becomes
`pagedserve::fused_add_rms_norm_quant` -> `(x_q, scale, x + residual)`: the quantized activation is produced in
the norm's epilogue and the float norm output never becomes a graph value. `quant_consumer` is the seam that
recognises the consumer. Static per-tensor W8A8 layers quantize with plain ops and are not fused.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import fx
from torch.fx.subgraph_rewriter import replace_pattern_with_filters

from pagedserve.compilation import fused_operators  # noqa: F401  (registers torch.ops.pagedserve.*)
from pagedserve.compilation.fusion_pass import (FusionPass, cast_back, cast_back_dtypes, rms_norm_eps_values,
                                                topologically_sort)
from pagedserve.layers.quantization import int8_quant_op  # noqa: F401  (registers the quantize op)


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

    def __call__(self, graph_module: fx.GraphModule) -> int:
        """Stage 1 (the norms), then stage 2 (norm + quant) on the fused norms; returns all replacements."""
        num_replaced = super().__call__(graph_module)
        num_quant_fused = 0
        for eps in self._fused_norm_eps_values(graph_module.graph):
            replaced = replace_pattern_with_filters(graph_module, self._norm_quant_pattern(eps),
                                                    self._norm_quant_replacement(eps),
                                                    match_filters=[self._feeds_only_a_quant])
            num_quant_fused += len(replaced)
        if num_quant_fused:
            topologically_sort(graph_module.graph)
            graph_module.graph.lint()
            graph_module.recompile()
        self.num_norm_quant_fused = num_quant_fused
        return num_replaced + num_quant_fused

    @staticmethod
    def _fused_norm_eps_values(graph: fx.Graph) -> list[float]:
        values: dict[float, None] = {}
        for node in graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.pagedserve.fused_add_rms_norm.default:
                values[node.args[3]] = None
        return list(values)

    @staticmethod
    def _norm_quant_pattern(eps: float) -> Callable[..., Any]:
        def norm_then_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> Any:
            result = torch.ops.pagedserve.fused_add_rms_norm.default(x, residual, weight, eps)
            quantized = torch.ops.pagedserve.quantize_per_token_int8.default(result[0])
            return quantized[0], quantized[1], result[1]

        return norm_then_quant

    @staticmethod
    def _norm_quant_replacement(eps: float) -> Callable[..., Any]:
        def fused(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> Any:
            result = torch.ops.pagedserve.fused_add_rms_norm_quant.default(x, residual, weight, eps)
            return result[0], result[1], result[2]

        return fused

    def _feeds_only_a_quant(self, match: Any, graph: fx.Graph, pattern_graph: fx.Graph) -> bool:
        norms = [node for node in match.nodes_map.values()
                 if node.op == "call_function" and node.target is torch.ops.pagedserve.fused_add_rms_norm.default]
        if len(norms) != 1:
            return False
        normed = [user for user in norms[0].users if user.target is operator.getitem and user.args[1] == 0]
        return len(normed) == 1 and self.quant_consumer(normed[0]) is not None

    def quant_consumer(self, norm_output: fx.Node) -> fx.Node | None:
        """The per-token int8 quantization consuming a fused norm's output when it is that output's only user,
        else None (the float output is needed elsewhere: nothing to fold)."""
        users = list(norm_output.users)
        if len(users) == 1 and users[0].op == "call_function" \
                and users[0].target is torch.ops.pagedserve.quantize_per_token_int8.default:
            return users[0]
        return None


__all__ = ["AddRMSNormQuantFusionPass"]
