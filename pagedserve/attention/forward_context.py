"""Forward context: per-step state visible to layers during one model forward.

The model runner enters `set_forward_context(...)` around `model.forward(input_ids, positions)`, so
models keep a small signature and attention layers find their metadata here. A layer-wise KV connector (the
PullConnector's push mode) rides here too: each attention layer calls `save_kv_layer` once its KV of the step is
written, and the context hands it to the connector the model runner named (none: nothing happens).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from pagedserve.attention.backend import AttentionMetadata

if TYPE_CHECKING:
    import torch

# (layer name, the layer's KV cache) -> None: KVConnectorWorker.save_kv_layer.
KVLayerSaver = Callable[[str, "torch.Tensor"], None]


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    # The KV connector's save_kv_layer for this forward (None: no layer-wise connector).
    kv_layer_saver: KVLayerSaver | None = None


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None,
                        kv_layer_saver: KVLayerSaver | None = None) -> Iterator[ForwardContext]:
    global _current
    assert _current is None, "forward contexts do not nest"
    _current = ForwardContext(attn_metadata=attn_metadata, kv_layer_saver=kv_layer_saver)
    try:
        yield _current
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    assert _current is not None, "no forward context: call the model inside set_forward_context()"
    return _current


def save_kv_layer(layer_name: str, kv_cache: "torch.Tensor") -> None:
    """An attention layer wrote its KV of this step into `kv_cache`: tell the layer-wise KV connector, if any
    (its send overlaps the layers still to run)."""
    saver = _current.kv_layer_saver if _current is not None else None
    if saver is not None:
        saver(layer_name, kv_cache)
