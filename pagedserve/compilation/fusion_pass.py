"""FusionPass: replace every occurrence of an op sequence in an FX graph by one fused operator.

A pass is a pattern factory plus a replacement factory, both plain functions traced by torch.fx, and
`torch.fx.subgraph_rewriter.replace_pattern_with_filters` does the matching and rewriting. Patterns are
written with exactly the op sequence of the layer code they target (layers/norm.py, models/qwen3.py,
layers/rotary.py), because FX matching is structural: a different spelling of the same math does not match.

Literal arguments (an RMSNorm eps, head counts, a scale) are part of the structure, so a pass first
scans the graph for the literal values it may need (`candidate_parameters`) and builds one exact pattern
per combination; unrelated literals therefore never match by accident. The dtype cast back after a
norm appears either as `x.dtype` (torch.fx.symbolic_trace) or as a literal dtype (Dynamo specialises
it): both forms are tried.
"""
from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import fx
from torch.fx.subgraph_rewriter import replace_pattern_with_filters


class FusionPass(ABC):
    """One pattern family -> one fused op. Calling the pass rewrites the graph in place."""

    name: str = "fusion"

    @abstractmethod
    def candidate_parameters(self, graph: fx.Graph) -> Iterable[tuple[Any, ...]]:
        """Literal parameter tuples worth trying on this graph (read from its nodes)."""

    @abstractmethod
    def pattern(self, *parameters: Any) -> Callable[..., Any]:
        """The unfused op sequence for these literals (a function of tensors only)."""

    @abstractmethod
    def replacement(self, *parameters: Any) -> Callable[..., Any]:
        """The fused call with the same inputs and outputs as `pattern(*parameters)`."""

    def __call__(self, graph_module: fx.GraphModule) -> int:
        """Rewrite every match; returns the number of replacements (0 leaves the graph untouched)."""
        num_replaced = 0
        for parameters in dict.fromkeys(self.candidate_parameters(graph_module.graph)):
            replaced = replace_pattern_with_filters(graph_module, self.pattern(*parameters),
                                                    self.replacement(*parameters))
            num_replaced += len(replaced)
        if num_replaced:
            # The rewriter inserts a replacement where its pattern began, but a pattern input may be
            # defined later (a lazily emitted get_attr weight, an operand computed between the
            # pattern's ops): restore a topological order.
            topologically_sort(graph_module.graph)
            graph_module.graph.lint()
            graph_module.recompile()
        return num_replaced


def topologically_sort(graph: fx.Graph) -> None:
    """Reorder nodes so every node follows its inputs, otherwise keeping the current order."""
    placed: set[fx.Node] = set()
    order: list[fx.Node] = []
    for root in list(graph.nodes):
        stack: list[tuple[fx.Node, bool]] = [(root, False)]
        while stack:  # iterative depth-first: a deep model graph would overflow recursion
            node, inputs_done = stack.pop()
            if node in placed:
                continue
            if inputs_done:
                placed.add(node)
                order.append(node)
                continue
            stack.append((node, True))
            stack.extend((parent, False) for parent in reversed(node.all_input_nodes) if parent not in placed)
    previous = order[0]
    for node in order[1:]:
        if previous.next is not node:
            previous.append(node)
        previous = node


# ---------------------------------------------------------------- literal scanners shared by the passes


def rms_norm_eps_values(graph: fx.Graph) -> list[float]:
    """eps of every `torch.rsqrt(variance + eps)` in the graph, in order of appearance, deduplicated."""
    values: dict[float, None] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.rsqrt and isinstance(node.args[0], fx.Node):
            summed = node.args[0]
            if summed.op == "call_function" and summed.target is operator.add and \
                    isinstance(summed.args[1], float):
                values[summed.args[1]] = None
    return list(values)


def cast_back_dtypes(graph: fx.Graph) -> list[torch.dtype | None]:
    """None (the `x.dtype` form) and every literal dtype a `.to(dtype)` in the graph casts to."""
    dtypes: dict[torch.dtype | None, None] = {None: None}
    for node in graph.nodes:
        if node.op == "call_method" and node.target == "to" and len(node.args) > 1 and \
                isinstance(node.args[1], torch.dtype):
            dtypes[node.args[1]] = None
    return list(dtypes)


def cast_back(hidden: torch.Tensor, like: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`hidden.to(like.dtype)` (traced form) or `hidden.to(dtype)` (specialised form)."""
    return hidden.to(like.dtype if dtype is None else dtype)


__all__ = ["FusionPass", "cast_back", "cast_back_dtypes", "rms_norm_eps_values", "topologically_sort"]
