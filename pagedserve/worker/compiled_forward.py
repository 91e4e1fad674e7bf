"""CompiledForward: the model forward through graph capture, on a ladder of padded token counts.

The model runner calls `forward(input_ids, positions)` exactly as it would call the model. A step of n
tokens is padded to the smallest ladder size b >= n (ids 0, positions 0 in the padded rows), the
compiled graph runs on b rows, and the first n rows of its output are returned. Padded rows never touch
the KV cache: the attention op hands the backend only `num_actual_tokens` rows. Steps above the largest
ladder size (long prefill chunks, which are compute bound anyway) run the eager model.

Every ladder size is compiled (or, on CUDA, captured) at start by `capture()`, with attention metadata
unset: layers attend the dummy tokens as one sequence and write no KV. With `dynamic_shapes=True` (the
default) Dynamo traces once with a symbolic token dimension and every size reuses that graph; sizes 0
and 1 are always specialised by Dynamo, so a one-token step is padded to the ladder's next size (>= 2)
rather than paying a second compile.

If capture fails (an op Dynamo cannot trace, a model-specific custom op), the engine warns, naming the
architecture, and runs eagerly.
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import torch
from torch import nn

from pagedserve.attention.forward_context import set_forward_context
from pagedserve.compilation.attention_op import attention_layers_in_use
from pagedserve.compilation.compiler_backend import CompilerBackend, CompileStats
from pagedserve.compilation.cuda_graph import padded_num_tokens
from pagedserve.config.compilation import CompilationConfig
from pagedserve.worker.kv_cache_allocation import attention_layers

logger = logging.getLogger(__name__)


def padded_size(num_tokens: int, sizes: list[int]) -> int | None:
    """The smallest ladder size >= num_tokens, or None when num_tokens is above the ladder."""
    index = bisect.bisect_left(sizes, num_tokens)
    return sizes[index] if index < len(sizes) else None


class CompiledForward:
    def __init__(self, model: nn.Module, config: CompilationConfig, device: torch.device,
                 architecture: str = "") -> None:
        self.model = model
        self.config = config
        self.device = device
        self.architecture = architecture or type(model).__name__
        sizes = list(config.capture_sizes)
        if config.dynamic_shapes:
            sizes = [size for size in sizes if size >= 2] or [2]
        self.sizes = sizes
        self.layers = {layer.layer_name: layer for layer in attention_layers(model)}
        self.backend = CompilerBackend(config, device.type, stable_tensors=self._stable_data_ptrs)
        self.compiled = torch.compile(model.forward, backend=self.backend, fullgraph=True, dynamic=False)
        # Persistent padded inputs (CUDA graphs read their inputs from fixed addresses).
        self.input_ids_buffer = torch.zeros(sizes[-1], dtype=torch.long, device=device)
        self.positions_buffer = torch.zeros(sizes[-1], dtype=torch.long, device=device)
        self.is_compiled = False
        self.num_compiled_steps = 0
        self.num_eager_steps = 0
        self.capture_seconds = 0.0

    @property
    def stats(self) -> CompileStats:
        return self.backend.stats

    def _stable_data_ptrs(self) -> set[int]:
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        return {tensor.data_ptr() for tensor in tensors}

    @torch.inference_mode()
    def capture(self) -> bool:
        """Compile (and on CUDA capture) every ladder size now; False (and eager from then on) on failure."""
        started = time.perf_counter()
        try:
            limit = len(self.sizes) + 8
            # Static shapes: one graph per size, so Dynamo must neither give up after its default
            # recompile limit nor turn the token dimension dynamic on its own after two sizes.
            with torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=limit * 4,
                                            automatic_dynamic_shapes=self.config.dynamic_shapes), \
                    set_forward_context(None):
                # One eager forward first: the layers' lazy one-time set-up (loading the native kernels, asking
                # what the CPU supports) takes locks and reads files, which Dynamo cannot trace.
                with attention_layers_in_use(self.layers), padded_num_tokens(self.sizes[0]):
                    self.model(self.input_ids_buffer[:self.sizes[0]], self.positions_buffer[:self.sizes[0]])
                # Largest first: with a symbolic token dimension, the trace is at a size > 1.
                for size in reversed(self.sizes):
                    self._run_padded(size, size, mark_dynamic=self.config.dynamic_shapes)
                    if self.device.type == "cuda":
                        self._run_padded(size, size)  # second call at a size captures its CUDA graphs
        except Exception as error:  # noqa: BLE001 - any compile failure falls back to eager, loudly
            logger.warning("graph capture failed for %s, running it eagerly (enforce_eager): %s: %s",
                           self.architecture, type(error).__name__, str(error).splitlines()[0] if str(error) else "")
            self.is_compiled = False
            return False
        self.is_compiled = True
        self.capture_seconds = time.perf_counter() - started
        stats = self.stats
        logger.info("graph capture of %s: %d sizes (%d..%d) in %.1f s; %d graph(s), cache hits %d, misses %d; "
                    "fusion replacements %s", self.architecture, len(self.sizes), self.sizes[0], self.sizes[-1],
                    self.capture_seconds, stats.num_graphs, stats.num_cache_hits, stats.num_cache_misses,
                    stats.num_replacements)
        return True

    def _run_padded(self, num_tokens: int, size: int, mark_dynamic: bool = False,
                    input_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        ids = self.input_ids_buffer[:size]
        pos = self.positions_buffer[:size]
        if input_ids is not None and positions is not None:
            ids[:num_tokens].copy_(input_ids)
            pos[:num_tokens].copy_(positions)
        ids[num_tokens:].zero_()
        pos[num_tokens:].zero_()
        if mark_dynamic:
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(pos, 0)
        with attention_layers_in_use(self.layers), padded_num_tokens(size):
            hidden_states = self.compiled(ids, pos)
        return hidden_states[:num_tokens]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        num_tokens = input_ids.shape[0]
        size = padded_size(num_tokens, self.sizes) if self.is_compiled else None
        if size is None:
            self.num_eager_steps += 1
            return self.model(input_ids, positions)
        self.num_compiled_steps += 1
        return self._run_padded(num_tokens, size, input_ids=input_ids, positions=positions)


def build_model_forward(model: nn.Module, engine_config: Any, device: torch.device) -> Any:
    """The callable the model runner runs each step: the model itself (eager) or a captured CompiledForward.

    Graph capture covers one-process engines; with tensor parallelism the forward holds collectives
    and stays eager (a capture failing on one rank only would leave the others waiting)."""
    config: CompilationConfig = engine_config.compilation_config
    if not config.is_compiled:
        return model
    architectures = getattr(engine_config.model_config.hf_config, "architectures", None) or [type(model).__name__]
    if engine_config.parallel_config.world_size_per_engine > 1:
        logger.warning("graph capture is not supported with tensor/pipeline parallelism; %s runs eagerly",
                       architectures[0])
        return model
    compiled = CompiledForward(model, config, device, architectures[0])
    compiled.capture()
    return compiled


__all__ = ["CompiledForward", "build_model_forward", "padded_size"]
