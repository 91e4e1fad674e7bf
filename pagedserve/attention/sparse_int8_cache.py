"""C8: the int8 cache of DeepSeek sparse attention layers (kv_cache_dtype="int8" for DeepseekV32ForCausalLM and
GlmMoeDsaForCausalLM).

One block id's page in one layer (an interleaved KVPageLayout, attention/kv_page_layout.py), per token:

    latent_nope   int8     [kv_lora_rank]       the compressed latent c, symmetric int8 per tile of LATENT_TILE_SIZE
                                                channels (the whole rank when it is smaller)
    latent_rope   bfloat16 [qk_rope_head_dim]   the rotated shared key k_pe (not quantized: few values, wide range)
    latent_scales float32  [num_tiles]          scale = max|tile| / 127 of each tile of c
    index_key     int8     [index_head_dim]     the indexer key after the normalized Hadamard rotation
                                                (attention/hadamard_rotation.py), symmetric int8 per token
    index_key_scale float32 []                  its scale
(layers without an indexer, GLM-5's "shared" ones, have only the three latent components). At DeepSeek-V3.2's
dimensions a token costs 512 + 64 * 2 + 4 * 4 = 656 bytes of latent and 128 + 4 of index key: 788 bytes against
1408 in bfloat16 (0.56x).

Reads happen in place: a sparse decode or prefill token gathers and dequantizes only its selected rows
(attention/sparse_mla.py); the indexer scores the int8 keys directly, with the query
rotated by the same matrix and quantized per token and head, and the two scales multiplied into the score
(s_q s_k (q~ . k~), the ReLU commutes with the non-negative scales; attention/lightning_indexer.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from pagedserve.attention.hadamard_rotation import hadamard_matrix, rotate
from pagedserve.attention.kv_cache_spec import KVCacheSpec
from pagedserve.attention.kv_page_layout import KVCacheComponent, KVPageLayout, kv_cache_components
from pagedserve.attention.kv_quantization import KV_SCALE_DTYPE, dequantize, quantize_per_token_head
from pagedserve.attention.lightning_indexer import INDEX_KEY_COMPONENT

LATENT_TILE_SIZE = 128
LATENT_NOPE_COMPONENT = "latent_nope"
LATENT_ROPE_COMPONENT = "latent_rope"
LATENT_SCALES_COMPONENT = "latent_scales"
INDEX_KEY_SCALE_COMPONENT = "index_key_scale"
ROPE_DTYPE = torch.bfloat16


def latent_tile_size(kv_lora_rank: int) -> int:
    """Channels per latent scale: LATENT_TILE_SIZE, or the whole rank when it is smaller (ValueError naming
    kv_lora_rank when the tiles do not divide it)."""
    tile = min(LATENT_TILE_SIZE, kv_lora_rank)
    if kv_lora_rank < 1 or kv_lora_rank % tile:
        raise ValueError(f"kv_lora_rank={kv_lora_rank} must be a multiple of {LATENT_TILE_SIZE} (or at most "
                         f"{LATENT_TILE_SIZE}) for the int8 sparse attention cache (kv_cache_dtype='int8')")
    return tile


@dataclass(frozen=True)
class SparseInt8PageLayout:
    """The C8 page of one DSA layer (see the module docstring); index_head_dim None: a layer without an indexer."""

    block_size: int
    kv_lora_rank: int
    rope_dim: int
    index_head_dim: int | None

    def __post_init__(self) -> None:
        latent_tile_size(self.kv_lora_rank)
        if self.index_head_dim is not None:
            hadamard_matrix(self.index_head_dim)  # refuses a size Sylvester's construction does not have

    @property
    def num_latent_tiles(self) -> int:
        return self.kv_lora_rank // latent_tile_size(self.kv_lora_rank)

    @cached_property
    def page_layout(self) -> KVPageLayout:
        components = [KVCacheComponent(LATENT_NOPE_COMPONENT, torch.int8, (self.kv_lora_rank,)),
                      KVCacheComponent(LATENT_ROPE_COMPONENT, ROPE_DTYPE, (self.rope_dim,)),
                      KVCacheComponent(LATENT_SCALES_COMPONENT, KV_SCALE_DTYPE, (self.num_latent_tiles,))]
        if self.index_head_dim is not None:
            components += [KVCacheComponent(INDEX_KEY_COMPONENT, torch.int8, (self.index_head_dim,)),
                           KVCacheComponent(INDEX_KEY_SCALE_COMPONENT, KV_SCALE_DTYPE, ())]
        return KVPageLayout.pack(self.block_size, components)

    def bytes_per_token(self) -> int:
        """Bytes of one token's rows over all components (the page without alignment padding, per token)."""
        return sum(component.page_bytes(1) for component in self.page_layout.components)


@dataclass(frozen=True)
class SparseMLAKVCacheSpec(KVCacheSpec):
    """A DSA layer's spec: the float page of KVCacheSpec (latent + index key), or under kv_cache_dtype="int8" the
    C8 page."""

    index_head_dim: int | None = None

    def page_layout(self, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> KVPageLayout:
        if kv_cache_dtype == "int8":
            return self.int8_sparse_page_layout(block_size).page_layout
        return super().page_layout(block_size, dtype, kv_cache_dtype)

    def int8_sparse_page_layout(self, block_size: int) -> SparseInt8PageLayout:
        return SparseInt8PageLayout(block_size, self.latent_rank, self.per_token_shape[0] - self.latent_rank,
                                    self.index_head_dim)


def is_sparse_int8_cache(kv_cache: torch.Tensor) -> bool:
    """Whether `kv_cache` (a layer's primary view) is a C8 page's latent_nope view."""
    return kv_cache.dtype == torch.int8 and LATENT_ROPE_COMPONENT in kv_cache_components(kv_cache)


def _component(kv_cache: torch.Tensor, name: str) -> torch.Tensor:
    return kv_cache_components(kv_cache)[name]


def quantize_latent_tiles(latent_nope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """c [..., kv_lora_rank] -> (int8 [..., kv_lora_rank], float32 scales [..., num_tiles]): each tile quantized
    as one row (quantize_per_token_head: error <= scale / 2 per element)."""
    rank = latent_nope.shape[-1]
    tile = latent_tile_size(rank)
    quantized, scales = quantize_per_token_head(latent_nope.reshape(*latent_nope.shape[:-1], rank // tile, tile))
    return quantized.reshape(latent_nope.shape), scales


def dequantize_latent_tiles(quantized: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The inverse of quantize_latent_tiles, in float32."""
    rank = quantized.shape[-1]
    tile = latent_tile_size(rank)
    tiles = quantized.reshape(*quantized.shape[:-1], rank // tile, tile)
    return dequantize(tiles, scales).reshape(*quantized.shape[:-1], rank)


def write_latent(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_lora_rank: int) -> None:
    """latent rows [n, kv_lora_rank + rope] into the C8 page at the flat slots `slot_mapping`: c quantized per
    tile with its scales, k_pe in bfloat16."""
    block_size = kv_cache.shape[1]
    slots = slot_mapping.to(torch.long)
    index = (slots // block_size, slots % block_size)
    quantized, scales = quantize_latent_tiles(latent[:, :kv_lora_rank])
    kv_cache.index_put_(index, quantized)
    _component(kv_cache, LATENT_SCALES_COMPONENT).index_put_(index, scales)
    _component(kv_cache, LATENT_ROPE_COMPONENT).index_put_(index, latent[:, kv_lora_rank:].to(ROPE_DTYPE))


def gather_latent_rows(kv_cache: torch.Tensor, block_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The latent rows at (block_ids, offsets) (int64, any equal shape [...]), dequantized: float32
    [..., kv_lora_rank + rope]. Reads only those rows of the page."""
    nope = dequantize_latent_tiles(kv_cache[block_ids, offsets],
                                   _component(kv_cache, LATENT_SCALES_COMPONENT)[block_ids, offsets])
    rope = _component(kv_cache, LATENT_ROPE_COMPONENT)[block_ids, offsets].float()
    return torch.cat([nope, rope], dim=-1)


def gather_latent_context(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One request's latent rows for positions [0, seq_len) (block_ids: its block table row), dequantized:
    float32 [seq_len, kv_lora_rank + rope]. Reads only the request's blocks."""
    block_size = kv_cache.shape[1]
    positions = torch.arange(seq_len, device=kv_cache.device)
    blocks = block_ids.to(torch.long)[positions // block_size]
    return gather_latent_rows(kv_cache, blocks, positions % block_size)


def dequantize_latent_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """The whole C8 latent as a float32 [num_blocks, block_size, kv_lora_rank + rope] cache (tests' oracle)."""
    nope = dequantize_latent_tiles(kv_cache, _component(kv_cache, LATENT_SCALES_COMPONENT))
    return torch.cat([nope, _component(kv_cache, LATENT_ROPE_COMPONENT).float()], dim=-1)


def index_key_caches(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 keys [num_blocks, block_size, index_head_dim], float32 scales [num_blocks, block_size]) of a C8 page
    with an indexer."""
    return _component(kv_cache, INDEX_KEY_COMPONENT), _component(kv_cache, INDEX_KEY_SCALE_COMPONENT)


def quantize_index_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index keys [n, index_head_dim] -> Hadamard-rotated int8 [n, index_head_dim] and float32 scales [n]."""
    return quantize_per_token_head(rotate(keys))


def write_index_keys(keys: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Index keys [n, index_head_dim] into the C8 page at `slot_mapping`: rotated, int8, with their scales."""
    key_cache, scale_cache = index_key_caches(kv_cache)
    block_size = key_cache.shape[1]
    slots = slot_mapping.to(torch.long)
    index = (slots // block_size, slots % block_size)
    quantized, scales = quantize_index_keys(keys)
    key_cache.index_put_(index, quantized)
    scale_cache.index_put_(index, scales)


def quantize_index_query(query: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index queries [n, H, index_head_dim] and head weights [n, H] -> (rotated int8 queries, weights times the
    queries' per token-head scales): the ReLU commutes with a non-negative scale, so the query scale folds into
    the weight, as the key scale folds into the score (lightning_indexer.index_scores)."""
    quantized, scales = quantize_per_token_head(rotate(query))
    return quantized, weights.float() * scales


__all__ = [
    "INDEX_KEY_SCALE_COMPONENT",
    "LATENT_NOPE_COMPONENT",
    "LATENT_ROPE_COMPONENT",
    "LATENT_SCALES_COMPONENT",
    "LATENT_TILE_SIZE",
    "ROPE_DTYPE",
    "SparseInt8PageLayout",
    "SparseMLAKVCacheSpec",
    "dequantize_latent_cache",
    "dequantize_latent_tiles",
    "gather_latent_context",
    "gather_latent_rows",
    "index_key_caches",
    "is_sparse_int8_cache",
    "latent_tile_size",
    "quantize_index_keys",
    "quantize_index_query",
    "quantize_latent_tiles",
    "write_index_keys",
    "write_latent",
]
