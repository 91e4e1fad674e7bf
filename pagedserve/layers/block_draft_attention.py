"""BlockDraftAttention: the attention of block drafters (DFlash, DSpark) over a paged context KV.

A block drafter keeps, per layer, K and V projected from the target's hidden states at every position the target
has computed ("context"), written into the layer's own paged cache (`write_context`). A draft forward then runs a
small block of query rows per request (the anchor token and mask tokens at the positions that follow it) whose
attention sees the request's whole context and every row of its own block (non-causal within the block). The
block's own K and V are never written to the cache: the next step writes the context there once those positions
hold verified tokens.

The cache has the dense layout ([2, num_blocks, block_size, num_kv_heads, head_dim]) so the worker sizes and
allocates it like any attention layer's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention.forward_context import get_forward_context
from pagedserve.attention.kv_cache_spec import KVCacheSpec
from pagedserve.platforms.sdpa_backends import cpu_attention_backends


@dataclass
class BlockDraftMetadata:
    """A draft block forward: request b's query rows are query_start_loc[b]:query_start_loc[b + 1], its context
    the cache slots context_slots[b] (positions 0, 1, ... in order), shared by every layer."""

    query_start_loc: list[int]
    context_slots: list[torch.Tensor]

    @staticmethod
    def over(query_start_loc: list[int], context_lens: list[int], block_table: torch.Tensor,
             block_size: int) -> "BlockDraftMetadata":
        """Request b's context: positions [0, context_lens[b]) through its row of `block_table`."""
        slots = []
        for b, context_len in enumerate(context_lens):
            positions = torch.arange(context_len, device=block_table.device)
            slots.append(block_table[b, positions // block_size].long() * block_size + positions % block_size)
        return BlockDraftMetadata(query_start_loc=query_start_loc, context_slots=slots)


class BlockDraftAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, prefix: str = "") -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.layer_name = prefix
        self.kv_cache: torch.Tensor | None = None

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(per_token_shape=(self.num_kv_heads, self.head_dim), leading_shape=(2,))

    def _flat_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kv_cache is None:
            raise RuntimeError(f"{self.layer_name}: no kv_cache is bound")
        shape = (-1, self.num_kv_heads, self.head_dim)
        return self.kv_cache[0].view(shape), self.kv_cache[1].view(shape)

    def write_context(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store context K / V ([n, num_kv_heads * head_dim]) at the given cache slots."""
        keys, values = self._flat_cache()
        keys[slot_mapping] = key.view(-1, self.num_kv_heads, self.head_dim).to(keys.dtype)
        values[slot_mapping] = value.view(-1, self.num_kv_heads, self.head_dim).to(values.dtype)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, BlockDraftMetadata):
            raise RuntimeError(f"{self.layer_name}: a block draft forward needs BlockDraftMetadata")
        keys, values = self._flat_cache()
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        output = torch.empty_like(query)
        group_size = self.num_heads // self.num_kv_heads
        for b, slots in enumerate(metadata.context_slots):
            start, end = metadata.query_start_loc[b], metadata.query_start_loc[b + 1]
            request_keys = torch.cat([keys[slots].to(key.dtype), key[start:end]])
            request_values = torch.cat([values[slots].to(value.dtype), value[start:end]])
            with cpu_attention_backends(query):
                attended = F.scaled_dot_product_attention(
                    query[start:end].transpose(0, 1),
                    request_keys.repeat_interleave(group_size, dim=1).transpose(0, 1),
                    request_values.repeat_interleave(group_size, dim=1).transpose(0, 1), scale=self.scale)
            output[start:end] = attended.transpose(0, 1)
        return output.reshape(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"


__all__ = ["BlockDraftAttention", "BlockDraftMetadata"]
