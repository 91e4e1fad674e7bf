"""CompilerBackend: the torch.compile backend of graph capture.

Dynamo hands it the model forward as one FX graph in which every attention call is a single opaque
`pagedserve::attention` node (compilation/attention_op.py). The backend

1. runs the enabled fusion passes (compilation/pass_manager.py) on that graph: the passes match the
   layer code's op sequences, which is the form Dynamo records (Inductor's later aten graph would not);
2. compiles the result with Inductor, its FX-graph and AOTAutograd caches rooted in the configured
   cache dir, so an identical graph compiled by a later start is loaded from disk;
3. on CUDA with `cudagraph_mode="piecewise"`, splits the graph at the attention nodes and wraps each
   compiled piece in per-size CUDA graphs (compilation/cuda_graph.py).

It counts what it did (graphs compiled, fusion replacements, cache hits and misses) so tests and logs
can say whether the passes fired and whether the cache was used.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from pagedserve.compilation import attention_op  # noqa: F401  (registers torch.ops.pagedserve.attention)
from pagedserve.compilation.pass_manager import build_fusion_pass_manager
from pagedserve.config.compilation import CompilationConfig

logger = logging.getLogger(__name__)

@dataclass
class CompileStats:
    num_graphs: int = 0
    # Inductor FX-graph cache and AOTAutograd cache lookups made while compiling this engine's graphs.
    num_cache_hits: int = 0
    num_cache_misses: int = 0
    num_replacements: dict[str, int] = field(default_factory=dict)
    compile_seconds: float = 0.0


@contextlib.contextmanager
def inductor_cache_dir(cache_dir: str) -> Iterator[None]:
    """Root Inductor's on-disk caches (FX graphs, AOTAutograd, generated kernels) at `cache_dir` while
    compiling. Inductor reads TORCHINDUCTOR_CACHE_DIR at each lookup, so setting it around the compile
    is enough; the previous value comes back afterwards (other engines may use another dir)."""
    os.makedirs(cache_dir, exist_ok=True)
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


def _cache_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return (inductor["fxgraph_cache_hit"] + aot["autograd_cache_hit"],
            inductor["fxgraph_cache_miss"] + aot["autograd_cache_miss"])


def is_attention_node(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (torch.ops.pagedserve.attention,
                                                           torch.ops.pagedserve.attention.default)


def split_at_attention(graph_module: fx.GraphModule) -> tuple[fx.GraphModule, list[str]]:
    """Cut the graph around every attention node: pieces alternate compute / attention / compute ...

    Returns the split module (its children `submod_<i>` are called in order) and the names of the
    compute pieces (the ones without an attention node), which are the pieces worth compiling and
    capturing. The split module computes exactly what the original graph computes.
    """
    from torch.fx.passes.split_module import split_module

    piece_index = 0
    piece_of: dict[fx.Node, int] = {}
    for node in graph_module.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_attention_node(node):
            piece_index += 1
            piece_of[node] = piece_index
            piece_index += 1
        else:
            piece_of[node] = piece_index
    split = split_module(graph_module, None, lambda node: piece_of[node], keep_original_order=True)
    attention_pieces = {f"submod_{index}" for node, index in piece_of.items() if is_attention_node(node)}
    compute_pieces = [name for name, _ in split.named_children() if name not in attention_pieces]
    return split, compute_pieces


class CompilerBackend:
    """Callable `(GraphModule, example_inputs) -> compiled callable`, for `torch.compile(backend=...)`."""

    def __init__(self, config: CompilationConfig, device_type: str,
                 stable_tensors: Callable[[], set[int]] | None = None) -> None:
        """`stable_tensors`: data pointers of tensors whose storage never moves (weights, buffers): CUDA
        graph pieces read those in place and copy every other input into their static buffers."""
        self.config = config
        self.device_type = device_type
        self.stable_tensors = stable_tensors or (lambda: set())
        self.fusion = build_fusion_pass_manager(config)
        self.stats = CompileStats(num_replacements=dict(self.fusion.num_replacements))

    def __call__(self, graph_module: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        import time

        started = time.perf_counter()
        self.fusion(graph_module)
        self.stats.num_replacements = dict(self.fusion.num_replacements)
        hits_before, misses_before = _cache_counts()
        with inductor_cache_dir(self.config.cache_dir or ""):
            if self.device_type == "cuda" and self.config.cudagraph_mode == "piecewise":
                compiled = self._compile_piecewise_cuda_graphs(graph_module, example_inputs)
            elif self.config.backend == "eager":
                compiled = graph_module.forward
            else:
                compiled = self._inductor(graph_module, example_inputs)
        hits_after, misses_after = _cache_counts()
        self.stats.num_graphs += 1
        self.stats.num_cache_hits += hits_after - hits_before
        self.stats.num_cache_misses += misses_after - misses_before
        self.stats.compile_seconds += time.perf_counter() - started
        logger.info("compiled graph %d: fusion replacements %s, cache hits %d, misses %d (%.1f s)",
                    self.stats.num_graphs, self.stats.num_replacements, hits_after - hits_before,
                    misses_after - misses_before, time.perf_counter() - started)
        return compiled

    @staticmethod
    def _inductor(graph_module: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(graph_module, example_inputs)

    def _compile_piecewise_cuda_graphs(self, graph_module: fx.GraphModule,
                                       example_inputs: list[Any]) -> Callable[..., Any]:
        """Each compute piece: Inductor, then CUDA graphs per ladder size; attention pieces stay eager."""
        from pagedserve.compilation.cuda_graph import PiecewiseCudaGraphPiece

        split, compute_pieces = split_at_attention(graph_module)
        sizes = self.config.capture_sizes
        for name in compute_pieces:
            piece = getattr(split, name)
            # Inductor compiles lazily on the first call with real inputs (the pieces' example inputs
            # are the intermediate activations, known only when the split graph runs).
            compiled_piece = piece if self.config.backend == "eager" else \
                torch.compile(piece, backend="inductor", fullgraph=True, dynamic=True)
            setattr(split, name, PiecewiseCudaGraphPiece(compiled_piece, sizes, self.stable_tensors()))
        return split


__all__ = ["CompileStats", "CompilerBackend", "inductor_cache_dir", "is_attention_node", "split_at_attention"]
