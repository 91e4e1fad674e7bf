"""Piecewise CUDA graph bookkeeping on the CPU: the split at attention, and capture/replay with a fake graph.

No GPU here: `torch.cuda.CUDAGraph` never runs in these tests. The fake graph records the callable at
capture and re-runs it into the captured output at replay, which is what a CUDA graph replay computes
from its persistent input buffers; the tests check which inputs are copied into those buffers, when
capture happens, and that results equal the plain piece.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from pagedserve.compilation.compiler_backend import split_at_attention
from pagedserve.compilation.cuda_graph import PiecewiseCudaGraphPiece, padded_num_tokens


class FakeGraph:
    def __init__(self) -> None:
        self.recorded = None
        self.num_replays = 0

    def replay(self) -> None:
        self.num_replays += 1
        runnable, inputs, output = self.recorded
        output.copy_(runnable(*inputs))


def test_piece_captures_once_per_ladder_size_and_replays_with_fresh_inputs() -> None:
    weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
    graphs: list[FakeGraph] = []

    def runnable(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w + 1

    def factory() -> FakeGraph:
        graphs.append(FakeGraph())
        return graphs[-1]

    piece_holder: dict[str, PiecewiseCudaGraphPiece] = {}

    @contextlib.contextmanager
    def capture(graph: FakeGraph):
        yield
        # What the graph recorded: the piece over its persistent inputs, writing its persistent output.
        captured_inputs = piece_holder["piece"]._capturing_inputs
        graph.recorded = (runnable, captured_inputs, piece_holder["piece"]._capturing_output)

    class Piece(PiecewiseCudaGraphPiece):
        def _capture(self, args):
            # Expose the static buffers to the fake capture context.
            original_runnable = self.runnable

            def spy(*static_inputs):
                self._capturing_inputs = static_inputs
                self._capturing_output = original_runnable(*static_inputs)
                return self._capturing_output

            self.runnable = spy
            try:
                return super()._capture(args)
            finally:
                self.runnable = original_runnable

    piece = Piece(runnable, sizes=[2, 4], stable_data_ptrs={weight.data_ptr()}, graph_factory=factory,
                  capture_context=capture)
    piece_holder["piece"] = piece
    with torch.inference_mode():
        for step in range(4):
            x = torch.randn(4, 4)
            with padded_num_tokens(4):
                got = piece(x, weight)
            torch.testing.assert_close(got, runnable(x, weight))
        assert len(graphs) == 1 and 4 in piece.graphs  # warm-up (step 0), capture (step 1), replays
        captured = piece.graphs[4]
        assert captured.volatile_indices == [0]  # the activation is copied; the weight is read in place
        assert captured.static_inputs[1] is weight
        assert graphs[0].num_replays == 3  # capture's own replay + two plain replays
        with padded_num_tokens(3):  # off the ladder: plain call, no graph
            x = torch.randn(3, 4)
            torch.testing.assert_close(piece(x, weight), runnable(x, weight))
        with padded_num_tokens(None):
            piece(torch.randn(5, 4), weight)
        assert len(graphs) == 1


def test_split_at_attention_alternates_pieces_and_computes_the_same() -> None:
    from pagedserve.attention.forward_context import set_forward_context
    from pagedserve.compilation.attention_op import attention_layers_in_use

    class Layer(nn.Module):
        def forward(self, query, key, value):
            return query + key * value

    class TwoLayers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            for name in ("a", "b"):
                h = self.proj(x).relu()
                x = x + torch.ops.pagedserve.attention(h, h * 2, h - 1, name)
            return x * 3

    module = TwoLayers()
    captured = []

    def backend(graph_module, example_inputs):
        captured.append(graph_module)
        return graph_module.forward

    x = torch.randn(5, 8)
    layers = {"a": Layer(), "b": Layer()}
    with attention_layers_in_use(layers), set_forward_context(None), torch.inference_mode():
        expected = module(x)
        torch.compile(module, backend=backend, fullgraph=True)(x)
        graph_module = captured[0]
        split, compute_pieces = split_at_attention(graph_module)
        num_pieces = len(list(split.named_children()))
        assert num_pieces == 5 and len(compute_pieces) == 3  # compute, attention, compute, attention, compute
        placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
        inputs = [x if "x" in n.name else dict(module.named_parameters())[
            "proj.weight" if "weight" in n.name else "proj.bias"] for n in placeholders]
        torch.testing.assert_close(split(*inputs), graph_module(*inputs))
        torch.testing.assert_close(graph_module(*inputs)[0] if isinstance(graph_module(*inputs), tuple)
                                   else graph_module(*inputs), expected)
