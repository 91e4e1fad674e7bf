"""MulsAddFusionPass: `x * scale + y` (scale a Python float) -> pagedserve::muls_add.

In MoE models this is the routed experts' output scaled by `routed_scaling_factor` plus the shared
expert's output; any `tensor * float + tensor` in the graph is fused the same way.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import fx

from pagedserve.compilation import fused_operators  # noqa: F401  (registers torch.ops.pagedserve.*)
from pagedserve.compilation.fusion_pass import FusionPass


class MulsAddFusionPass(FusionPass):
    name = "fuse_muls_add"

    def candidate_parameters(self, graph: fx.Graph) -> Iterable[tuple[Any, ...]]:
        for node in graph.nodes:
            if node.op == "call_function" and node.target is operator.mul and len(node.args) == 2 and \
                    isinstance(node.args[0], fx.Node) and isinstance(node.args[1], float):
                yield (node.args[1],)

    def pattern(self, scale: float) -> Callable[..., Any]:
        def mul_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x * scale + y

        return mul_add

    def replacement(self, scale: float) -> Callable[..., Any]:
        def fused(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.ops.pagedserve.muls_add.default(x, y, scale)

        return fused


__all__ = ["MulsAddFusionPass"]
