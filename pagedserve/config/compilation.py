"""CompilationConfig: graph capture of the model forward and the FX fusion passes run on the captured graph.

vLLM's names. `mode` picks eager (no capture) or compiled; `cudagraph_capture_sizes` is the ladder of
token counts a step is padded up to (the same ladder serves the CPU's compiled graphs and CUDA graphs);
the three `fuse_*` flags choose the fusion passes; `cache_dir` holds the compiler's on-disk caches so a
second start reuses the first one's work. `EngineConfig.create(compilation_config=..., enforce_eager=...)`
resolves the defaults against the scheduler's token budget (`resolve`).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

# Eager (no graph capture) and compiled: the vLLM mode numbers 0 (NONE) and 3 (VLLM_COMPILE), by name.
MODE_NONE = "none"
MODE_COMPILE = "compile"
_MODE_BY_NUMBER = {0: MODE_NONE, 1: MODE_COMPILE, 2: MODE_COMPILE, 3: MODE_COMPILE}
# CUDA graphs: none, or "piecewise" (every piece of the forward between two attention calls is one
# captured graph per ladder size; attention, which reads host metadata, runs eagerly between them).
CUDAGRAPH_MODES = ("none", "piecewise")
DEFAULT_MAX_CAPTURE_SIZE = 512
BACKENDS = ("inductor", "eager")


def default_capture_sizes(max_size: int) -> tuple[int, ...]:
    """vLLM's ladder: 1, 2, 4, then every 8 up to 256, then every 16, up to `max_size` (which is included)."""
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_size + 1, 16))
    sizes = [size for size in sizes if size <= max_size]
    if not sizes or sizes[-1] != max_size:
        sizes.append(max_size)
    return tuple(sizes)


def default_cache_dir() -> str:
    from pagedserve.cache_directory import cache_root

    return os.path.join(cache_root(), "compile")


@dataclass(frozen=True)
class CompilationConfig:
    # "none" (eager) or "compile" (torch.compile of the model forward); None: the platform's default,
    # decided by `resolve` (`default_mode`: eager for now, see docs/params-06-compilation.md).
    mode: str | None = None
    # Token counts a step is padded up to before a compiled graph runs (ascending, unique). None: the
    # default ladder up to `max_cudagraph_capture_size`. A step with more tokens runs eagerly.
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    # Upper end of the default ladder (capped by max_num_batched_tokens at resolve time).
    max_cudagraph_capture_size: int = DEFAULT_MAX_CAPTURE_SIZE
    # CUDA only: "piecewise" CUDA graphs per ladder size, or "none".
    cudagraph_mode: str = "piecewise"
    # True: one compiled graph with a symbolic token dimension serves every ladder size (one compile);
    # False: one static-shape compile per ladder size (the "static kernel" idea; slow start).
    dynamic_shapes: bool = True
    # residual add + RMSNorm (+ a following quantisation, once quantised models exist) -> one op
    fuse_norm_quant: bool = True
    # Qwen3-style per-head q/k RMSNorm + RoPE -> one op
    fuse_qknorm_rope: bool = True
    # x * scale + y -> one op
    fuse_muls_add: bool = True
    # What compiles the captured (and fused) graph: "inductor" (generated C++/Triton kernels) or "eager"
    # (the captured FX graph runs as Python: capture, attention split, padding and fusion passes without
    # code generation; cheap to build, used by tests and for debugging).
    backend: str = "inductor"
    # Inductor / AOTAutograd caches (None: ~/.cache/pagedserve/compile).
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("fuse_norm_quant", "fuse_qknorm_rope", "fuse_muls_add", "dynamic_shapes"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"compilation_config.{name}={value!r} must be a bool (True or False)")
        if self.mode is not None and self.mode not in (MODE_NONE, MODE_COMPILE):
            raise ValueError(f"compilation_config.mode={self.mode!r} must be one of "
                             f"{[MODE_NONE, MODE_COMPILE]} (or 0..3, vLLM's numbers) or None (platform default)")
        if self.backend not in BACKENDS:
            raise ValueError(f"compilation_config.backend={self.backend!r} must be one of {list(BACKENDS)}")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"compilation_config.cudagraph_mode={self.cudagraph_mode!r} must be one of "
                             f"{list(CUDAGRAPH_MODES)}")
        if isinstance(self.max_cudagraph_capture_size, bool) or not isinstance(self.max_cudagraph_capture_size, int) \
                or self.max_cudagraph_capture_size < 1:
            raise ValueError(f"compilation_config.max_cudagraph_capture_size={self.max_cudagraph_capture_size!r} "
                             f"must be an integer >= 1")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
                raise ValueError(f"compilation_config.cudagraph_capture_sizes={list(sizes)!r} must be a non-empty "
                                 f"list of integers >= 1")
            if list(sizes) != sorted(set(sizes)):
                raise ValueError(f"compilation_config.cudagraph_capture_sizes={list(sizes)!r} must be ascending "
                                 f"without repeats")
        if self.cache_dir is not None and (not isinstance(self.cache_dir, str) or not self.cache_dir):
            raise ValueError(f"compilation_config.cache_dir={self.cache_dir!r} must be a non-empty path string")

    @property
    def is_compiled(self) -> bool:
        return self.mode == MODE_COMPILE

    @property
    def capture_sizes(self) -> tuple[int, ...]:
        """The ladder (after `resolve`, always concrete)."""
        if self.cudagraph_capture_sizes is not None:
            return self.cudagraph_capture_sizes
        return default_capture_sizes(self.max_cudagraph_capture_size)

    def resolve(self, *, max_num_batched_tokens: int, enforce_eager: bool, device_type: str) -> CompilationConfig:
        """Concrete mode, ladder and cache dir for an engine with this token budget and platform."""
        if not isinstance(enforce_eager, bool):
            raise ValueError(f"enforce_eager={enforce_eager!r} must be true or false")
        mode = self.mode
        if enforce_eager:
            mode = MODE_NONE
        elif mode is None:
            mode = default_mode(device_type)
        if self.cudagraph_capture_sizes is not None:
            if self.cudagraph_capture_sizes[-1] > max_num_batched_tokens:
                raise ValueError(f"compilation_config.cudagraph_capture_sizes={list(self.cudagraph_capture_sizes)} "
                                 f"has sizes above max_num_batched_tokens={max_num_batched_tokens}: no step has "
                                 f"that many tokens")
            sizes = self.cudagraph_capture_sizes
        else:
            sizes = default_capture_sizes(min(self.max_cudagraph_capture_size, max_num_batched_tokens))
        return dataclasses.replace(self, mode=mode, cudagraph_capture_sizes=tuple(sizes),
                                   cache_dir=os.path.abspath(os.path.expanduser(self.cache_dir or default_cache_dir())))

    @staticmethod
    def parse(value: CompilationConfig | dict[str, Any] | str | None) -> CompilationConfig:
        """From a CompilationConfig, a dict, a JSON object string (the CLI flag) or None (defaults)."""
        if value is None:
            return CompilationConfig()
        if isinstance(value, CompilationConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"compilation_config={value!r} is not a JSON object: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"compilation_config={value!r} must be a CompilationConfig, a dict or a JSON object")
        fields = dict(value)
        if "level" in fields:  # vLLM's older name for mode
            level = fields.pop("level")
            fields.setdefault("mode", level)
        mode = fields.get("mode")
        if isinstance(mode, int) and not isinstance(mode, bool):
            if mode not in _MODE_BY_NUMBER:
                raise ValueError(f"compilation_config.mode={mode} must be 0 (none) .. 3 (compile)")
            fields["mode"] = _MODE_BY_NUMBER[mode]
        elif isinstance(mode, str):
            fields["mode"] = mode.lower()
        if isinstance(fields.get("cudagraph_mode"), str):
            fields["cudagraph_mode"] = fields["cudagraph_mode"].lower()
        if isinstance(fields.get("cudagraph_capture_sizes"), list):
            fields["cudagraph_capture_sizes"] = tuple(fields["cudagraph_capture_sizes"])
        known = {field.name for field in dataclasses.fields(CompilationConfig)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"compilation_config has unknown field(s) {unknown}; known: {sorted(known)}")
        return CompilationConfig(**fields)


def default_mode(device_type: str) -> str:
    """Eager on both platforms for now: on the CPU by measurement (docs/params-06-compilation.md); on
    CUDA because the piecewise CUDA-graph path has not yet run on a GPU (opt in with mode="compile")."""
    return CUDA_DEFAULT_MODE if device_type == "cuda" else CPU_DEFAULT_MODE


# Decided by measurement (docs/params-06-compilation.md).
CPU_DEFAULT_MODE = MODE_NONE
# To become MODE_COMPILE once the CUDA-graph path has been run and tested on a GPU.
CUDA_DEFAULT_MODE = MODE_NONE


__all__ = [
    "BACKENDS",
    "CPU_DEFAULT_MODE",
    "CUDAGRAPH_MODES",
    "MODE_COMPILE",
    "MODE_NONE",
    "CompilationConfig",
    "default_cache_dir",
    "default_capture_sizes",
    "default_mode",
]
