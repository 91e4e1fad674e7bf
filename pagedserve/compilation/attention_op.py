"""The attention split point of graph capture: one opaque `torch.library` op per Attention call.

An attention backend reads host-side metadata (request lengths, block tables as Python lists) and
writes the paged KV cache; none of that can live inside a captured graph. While Dynamo traces the
model, `Attention.forward` calls `torch.ops.pagedserve.attention(query, key, value, layer_name)`
instead of its backend; the compiled graph keeps that call as one extern node, and at run time the op
finds the layer by name and runs the layer's ordinary (eager) forward, so any registered backend works.

Padding. Compiled graphs run on padded token counts (a bucket of the capture ladder). The op hands the
backend only the first `metadata.num_actual_tokens` rows, so padded rows never write the KV cache and
never reach a backend, and returns zeros for the padded rows (their outputs are dropped by the caller).

The name -> layer map is installed by whoever runs the compiled graph (`attention_layers_in_use`): a
context variable rather than a global registry, so several engines in one process never see each
other's layers (their layer names are the same).
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torch.library import custom_op, register_fake

from pagedserve.attention.forward_context import get_forward_context

_layers_in_use: contextvars.ContextVar[Mapping[str, nn.Module] | None] = contextvars.ContextVar(
    "pagedserve_attention_layers", default=None)


@contextlib.contextmanager
def attention_layers_in_use(layers: Mapping[str, nn.Module]) -> Iterator[None]:
    """Make `layers` (layer_name -> Attention module) the ones the attention op dispatches to."""
    token = _layers_in_use.set(layers)
    try:
        yield
    finally:
        _layers_in_use.reset(token)


def _layer(layer_name: str) -> nn.Module:
    layers = _layers_in_use.get()
    if layers is None or layer_name not in layers:
        raise RuntimeError(f"attention op for {layer_name!r} ran outside attention_layers_in_use(...) "
                           f"(a compiled graph was called without its model's layers installed)")
    return layers[layer_name]


@custom_op("pagedserve::attention", mutates_args=())
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_name: str) -> torch.Tensor:
    # The KV cache is written as a side effect (it is layer state, not an argument): the op is opaque
    # to the compiler, and its output feeds the rest of the layer, so it is never dropped or reordered
    # across the ops it depends on.
    layer = _layer(layer_name)
    metadata = get_forward_context().attn_metadata
    num_rows = query.shape[0]
    num_actual = num_rows if metadata is None else metadata.num_actual_tokens
    if num_actual == num_rows:
        return layer(query, key, value)
    output = query.new_zeros(num_rows, query.shape[1])
    output[:num_actual] = layer(query[:num_actual], key[:num_actual], value[:num_actual])
    return output


@register_fake("pagedserve::attention")
def _attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_name: str) -> torch.Tensor:
    # Attention's output has the query's flat shape: [num_tokens, num_heads * head_dim].
    return torch.empty_like(query)


__all__ = ["attention", "attention_layers_in_use"]
