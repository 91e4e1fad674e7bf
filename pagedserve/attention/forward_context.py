"""Forward context: per-step state visible to layers during one model forward.

The model runner enters `set_forward_context(...)` around `model.forward(input_ids, positions)`, so
models keep a small signature and attention layers find their metadata here.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from pagedserve.attention.backend import AttentionMetadata


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None) -> Iterator[ForwardContext]:
    global _current
    assert _current is None, "forward contexts do not nest"
    _current = ForwardContext(attn_metadata=attn_metadata)
    try:
        yield _current
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    assert _current is not None, "no forward context: call the model inside set_forward_context()"
    return _current
