"""Attention module: the model-side face of the paged KV cache.

Holds one layer's `kv_cache` (set by the worker: [2, num_blocks, block_size, num_kv_heads, head_dim])
and, per step, reads the attention metadata from the forward context and calls the backend. Without
metadata (a profiling or dummy run) it attends the given tokens as one causal sequence and leaves the
cache untouched.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention import current_attention_backend_name, get_attention_backend
from pagedserve.attention.forward_context import get_forward_context, save_kv_layer
from pagedserve.attention.kv_cache_spec import KVCacheSpec
from pagedserve.layers.watched_attributes import WatchedAttributes
from pagedserve.platforms.sdpa_backends import cpu_attention_backends


class Attention(WatchedAttributes, nn.Module):
    """Multi-head / grouped-query attention over the paged KV cache.

    Inputs are flat per token: query [num_tokens, num_heads * head_dim], key and value
    [num_tokens, num_kv_heads * head_dim]; the output is [num_tokens, num_heads * head_dim].
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int | None = None,
                 sliding_window: int | None = None, prefix: str = "", backend_name: str | None = None) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(f"{prefix}: num_heads={num_heads} must be a positive multiple of "
                             f"num_kv_heads={num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"{prefix}: sliding_window={sliding_window} must be None or >= 1")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.layer_name = prefix
        self.backend = get_attention_backend(backend_name or current_attention_backend_name())
        # Plain attribute (not a buffer): the cache is runtime state, never part of the checkpoint.
        self.kv_cache: torch.Tensor | None = None

    def kv_cache_spec(self) -> KVCacheSpec:
        """Full K and V per token: [2, num_blocks, block_size, num_kv_heads, head_dim]."""
        return KVCacheSpec(per_token_shape=(self.num_kv_heads, self.head_dim), leading_shape=(2,), supports_int8=True)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # Graph capture splits here: the backend call (host metadata, KV writes) stays out of the
            # graph as one opaque op that calls this method again at run time (compilation/attention_op.py).
            from pagedserve.compilation.attention_op import attention

            return attention(query, key, value, self.layer_name)
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        metadata = get_forward_context().attn_metadata
        if metadata is None:
            output = self._attend_as_one_sequence(query, key, value)
        else:
            if self.kv_cache is None:
                raise RuntimeError(f"{self.layer_name}: attention metadata is set but no kv_cache is bound")
            output = self.backend.forward(query, key, value, self.kv_cache, metadata, self.scale,
                                          self.sliding_window)
            save_kv_layer(self.layer_name, self.kv_cache)
        return output.reshape(num_tokens, self.num_heads * self.head_dim)

    def _attend_as_one_sequence(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        num_tokens = query.shape[0]
        group_size = self.num_heads // self.num_kv_heads
        key = key.repeat_interleave(group_size, dim=1)
        value = value.repeat_interleave(group_size, dim=1)
        positions = torch.arange(num_tokens, device=query.device)
        distance = positions.unsqueeze(1) - positions.unsqueeze(0)  # query row minus key column
        is_visible = distance >= 0
        if self.sliding_window is not None:
            is_visible &= distance < self.sliding_window
        with cpu_attention_backends(query):
            output = F.scaled_dot_product_attention(
                query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), attn_mask=is_visible,
                scale=self.scale,
            )
        return output.transpose(0, 1)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"scale={self.scale}, sliding_window={self.sliding_window}, backend={self.backend.name}")
