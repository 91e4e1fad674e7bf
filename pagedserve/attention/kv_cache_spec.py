"""KVCacheSpec: what one attention layer stores per token in the paged cache.

Each attention layer (the dense `Attention`, the latent `MLAAttention`, ...) declares its spec through a
`kv_cache_spec()` method; the worker sizes the cache from the sum of the layers' bytes per block and
allocates one tensor per layer of shape `leading_shape + (num_blocks, block_size) + per_token_shape`:

- dense attention: leading (2,) for K and V, per token (num_kv_heads, head_dim);
- MLA: no leading dimension, per token (kv_lora_rank + qk_rope_head_dim,): one compressed latent and the
  shared rotary key, instead of full per-head K and V.
All layers share one block table (one block id pool), so layers with different specs work side by side.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    per_token_shape: tuple[int, ...]
    leading_shape: tuple[int, ...] = ()

    def tensor_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (*self.leading_shape, num_blocks, block_size, *self.per_token_shape)

    def elements_per_token(self) -> int:
        return math.prod(self.leading_shape) * math.prod(self.per_token_shape)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return block_size * self.elements_per_token() * element_size
