"""Piecewise CUDA graphs: one compiled piece of the forward, captured once per ladder size and replayed.

The forward is split at its attention calls (compiler_backend.split_at_attention); every compute piece
between two attention calls is wrapped in a `PiecewiseCudaGraphPiece`. The caller (the compiled
forward) pads each step to a ladder size and announces it with `padded_num_tokens(size)`; a piece
seeing a ladder size for the first time runs once (warm-up: lazy compilation, allocator pools) and then
captures a CUDA graph for it; later calls at that size copy their volatile inputs (activations, input
ids, positions: anything whose storage is not a weight or buffer) into the graph's persistent input
buffers and replay it. Attention stays eager between the pieces, so its host-side metadata is fresh
every step. Sizes off the ladder run the piece without a graph.

NOT RUN ON A GPU: this repository's machine has no CUDA device. The size bookkeeping and the
input-buffer logic are unit-tested on the CPU with a fake graph object (tests/compilation/); the capture
and replay calls themselves (`torch.cuda.CUDAGraph`) have never executed here.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

_padded_num_tokens: contextvars.ContextVar[int | None] = contextvars.ContextVar("pagedserve_padded_tokens",
                                                                             default=None)


@contextlib.contextmanager
def padded_num_tokens(size: int | None) -> Iterator[None]:
    """The padded token count of the forward running inside this block (None: not on the ladder)."""
    token = _padded_num_tokens.set(size)
    try:
        yield
    finally:
        _padded_num_tokens.reset(token)


def current_padded_num_tokens() -> int | None:
    return _padded_num_tokens.get()


@dataclass
class CapturedGraph:
    graph: Any  # torch.cuda.CUDAGraph (or a test double with replay())
    static_inputs: list[Any]
    # Positions of the inputs that are copied into `static_inputs` before each replay.
    volatile_indices: list[int]
    static_output: Any


def _cuda_graph_factory() -> Any:
    return torch.cuda.CUDAGraph()


def _capture_context(graph: Any) -> Any:
    return torch.cuda.graph(graph)


class PiecewiseCudaGraphPiece:
    """Callable with the piece's signature; captures per ladder size, replays afterwards."""

    def __init__(self, runnable: Callable[..., Any], sizes: Sequence[int], stable_data_ptrs: set[int],
                 graph_factory: Callable[[], Any] = _cuda_graph_factory,
                 capture_context: Callable[[Any], Any] = _capture_context) -> None:
        self.runnable = runnable
        self.sizes = frozenset(sizes)
        self.stable_data_ptrs = stable_data_ptrs
        self.graph_factory = graph_factory
        self.capture_context = capture_context
        self.graphs: dict[int, CapturedGraph] = {}
        self.num_warmups: dict[int, int] = {}

    def __call__(self, *args: Any) -> Any:
        size = current_padded_num_tokens()
        if size is None or size not in self.sizes:
            return self.runnable(*args)
        captured = self.graphs.get(size)
        if captured is None:
            if self.num_warmups.get(size, 0) == 0:
                # First call at this size: run plainly (compiles lazily, warms the allocator) before capture.
                self.num_warmups[size] = 1
                return self.runnable(*args)
            captured = self._capture(args)
            self.graphs[size] = captured
            return captured.static_output
        for index in captured.volatile_indices:
            captured.static_inputs[index].copy_(args[index])
        captured.graph.replay()
        return captured.static_output

    def _capture(self, args: tuple[Any, ...]) -> CapturedGraph:
        volatile = [index for index, arg in enumerate(args)
                    if isinstance(arg, torch.Tensor) and arg.data_ptr() not in self.stable_data_ptrs]
        static_inputs = list(args)
        for index in volatile:
            static_inputs[index] = args[index].clone()
        graph = self.graph_factory()
        with self.capture_context(graph):
            static_output = self.runnable(*static_inputs)
        # Capture records the kernels without a guaranteed run: replay once for this call's result.
        graph.replay()
        return CapturedGraph(graph=graph, static_inputs=static_inputs, volatile_indices=volatile,
                             static_output=static_output)


__all__ = ["PiecewiseCudaGraphPiece", "current_padded_num_tokens", "padded_num_tokens"]
