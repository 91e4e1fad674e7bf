"""KVCacheSpec: what one attention layer stores per token in the paged cache.

Each attention layer (the dense `Attention`, the latent `MLAAttention`, ...) declares its spec through a
`kv_cache_spec()` method; the worker sizes the cache from the sum of the layers' bytes per block and
allocates one tensor per layer of shape `leading_shape + (num_blocks, block_size) + per_token_shape`:

- dense attention: leading (2,) for K and V, per token (num_kv_heads, head_dim);
- MLA: no leading dimension, per token (kv_lora_rank + qk_rope_head_dim,): one compressed latent and the
  shared rotary key, instead of full per-head K and V.
All layers share one block table (one block id pool), so layers with different specs work side by side.

Every spec becomes a page layout (`page_layout`, attention/kv_page_layout.py): its K/V or latent is the first
component (the view the layer holds as `kv_cache`); `extra_components` add per-token data kept in the same page
under the same block ids (the DSA indexer's keys). A lone component is stored planar, i.e. as the plain contiguous
tensor above; a page with extra components is interleaved (everything one block id owns is contiguous).

With kv_cache_dtype="int8" a layer whose spec says `supports_int8` gets byte pages instead
(attention/kv_quantization.py): dense K/V (leading (2,), per token (num_kv_heads, head_dim)) as int8 K/V plus their
float32 scales; MLA (`latent_rank` > 0) as int8 latent rows plus a scale for c and one for k_pe. DeepSeek sparse
attention layers declare a SparseMLAKVCacheSpec (attention/sparse_int8_cache.py), whose int8 page is C8. Other
kinds (the block drafter's K/V) refuse it at start.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedserve.attention.kv_page_layout import KVCacheComponent, KVPageLayout

if TYPE_CHECKING:
    from pagedserve.attention.kv_quantization import (
        Int8KVPageLayout,
        Int8LatentPageLayout,
    )

# The name of the first component of a float page: the K/V planes or the MLA latent.
PRIMARY_COMPONENT = "kv"


@dataclass(frozen=True)
class ExtraKVComponent:
    """Per-token data a layer keeps beside its K/V or latent, in the same page: `per_token_shape` values of
    `dtype` (None: the cache's dtype)."""

    name: str
    per_token_shape: tuple[int, ...]
    dtype: torch.dtype | None = None


@dataclass(frozen=True)
class KVCacheSpec:
    per_token_shape: tuple[int, ...]
    leading_shape: tuple[int, ...] = ()
    # Whether the layer reads and writes an int8 page cache (kv_cache_dtype="int8").
    supports_int8: bool = False
    # MLA: the compressed latent's width at the start of the row (the rest is the rotary key); 0 for dense K/V.
    latent_rank: int = 0
    extra_components: tuple[ExtraKVComponent, ...] = ()

    def tensor_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (*self.leading_shape, num_blocks, block_size, *self.per_token_shape)

    def elements_per_token(self) -> int:
        return math.prod(self.leading_shape) * math.prod(self.per_token_shape)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        return self.page_layout(block_size, dtype, kv_cache_dtype).page_bytes

    def page_layout(self, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> KVPageLayout:
        """The page one block id holds for this layer: the int8 page (kv_cache_dtype="int8"), else the K/V or
        latent in `dtype` followed by the extra components."""
        if kv_cache_dtype == "int8":
            if self.extra_components:
                raise ValueError(f"kv_cache_dtype='int8' is not supported for layers with extra cache components "
                                 f"({[c.name for c in self.extra_components]}) yet; use kv_cache_dtype='auto'")
            return self.int8_page_layout(block_size).page_layout
        components = [KVCacheComponent(PRIMARY_COMPONENT, dtype, self.per_token_shape, self.leading_shape)]
        components += [KVCacheComponent(extra.name, extra.dtype or dtype, extra.per_token_shape)
                       for extra in self.extra_components]
        return KVPageLayout.pack(block_size, components, is_interleaved=bool(self.extra_components))

    def int8_page_layout(self, block_size: int) -> Int8KVPageLayout | Int8LatentPageLayout:
        """The int8 page of a dense K/V or MLA latent spec (ValueError for a spec without int8 support)."""
        from pagedserve.attention.kv_quantization import (
            Int8KVPageLayout,
            Int8LatentPageLayout,
        )

        if self.supports_int8 and self.latent_rank > 0 and self.leading_shape == () \
                and len(self.per_token_shape) == 1:
            return Int8LatentPageLayout(block_size, self.latent_rank, self.per_token_shape[0] - self.latent_rank)
        if not self.supports_int8 or self.leading_shape != (2,) or len(self.per_token_shape) != 2:
            raise ValueError(f"kv_cache_dtype='int8' needs a dense K/V cache spec; this layer's is {self}")
        num_kv_heads, head_dim = self.per_token_shape
        return Int8KVPageLayout(block_size, num_kv_heads, head_dim)
