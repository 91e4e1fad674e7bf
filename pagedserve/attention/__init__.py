"""Attention backends: the interface (backend.py), the forward context and a registry by name."""
from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Iterator

from pagedserve.attention.backend import AttentionBackend, AttentionMetadata

# name -> (module, class); imported lazily so a backend's dependencies load only when it is chosen.
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch_paged": ("pagedserve.attention.torch_paged", "TorchPagedAttentionBackend"),
    # Native in-place paged decode kernel for the CPU (built at first use; see attention/cpu_native.py).
    "cpu_native": ("pagedserve.attention.cpu_native", "CpuNativeAttentionBackend"),
    # decode_context_parallel_size > 1: KV positions split over a group of TP ranks, merged by log-sum-exp.
    "decode_context_parallel": ("pagedserve.attention.decode_context_parallel", "DecodeContextParallelBackend"),
}

# The backend Attention layers built inside `use_attention_backend(name)` take (the worker sets the
# engine config's choice around model loading); None: the platform's default.
_build_backend_name: str | None = None


@contextmanager
def use_attention_backend(name: str | None) -> Iterator[None]:
    """Attention layers constructed inside this block use backend `name` (None: the platform default)."""
    global _build_backend_name
    previous, _build_backend_name = _build_backend_name, name
    try:
        yield
    finally:
        _build_backend_name = previous


def current_attention_backend_name() -> str:
    """The backend name for a layer built now: the enclosing use_attention_backend's, else the platform's."""
    if _build_backend_name is not None:
        return _build_backend_name
    from pagedserve.platforms import current_platform

    return current_platform().default_attention_backend()


def attention_backend_names() -> list[str]:
    """The registered backend names (what `attention_backend` accepts)."""
    return sorted(_BACKENDS)


def get_attention_backend(name: str) -> AttentionBackend:
    """A new instance of the attention backend registered under `name`."""
    if name not in _BACKENDS:
        raise ValueError(f"attention backend={name!r} is not supported; supported: {sorted(_BACKENDS)}")
    module_name, class_name = _BACKENDS[name]
    backend_class = getattr(importlib.import_module(module_name), class_name)
    return backend_class()


__all__ = ["AttentionBackend", "AttentionMetadata", "attention_backend_names", "current_attention_backend_name", "get_attention_backend",
           "use_attention_backend"]
