"""Attention backends: the interface (backend.py), the forward context and a registry by name."""
from __future__ import annotations

import importlib

from pagedserve.attention.backend import AttentionBackend, AttentionMetadata

# name -> (module, class); imported lazily so a backend's dependencies load only when it is chosen.
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch_paged": ("pagedserve.attention.torch_paged", "TorchPagedAttentionBackend"),
}


def get_attention_backend(name: str) -> AttentionBackend:
    """A new instance of the attention backend registered under `name`."""
    if name not in _BACKENDS:
        raise ValueError(f"attention backend={name!r} is not supported; supported: {sorted(_BACKENDS)}")
    module_name, class_name = _BACKENDS[name]
    backend_class = getattr(importlib.import_module(module_name), class_name)
    return backend_class()


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
