"""The int8 KV cache (kv_cache_dtype="int8"): byte pages holding int8 K/V and their scales, quantize and dequantize.

Quantization: symmetric, per token and per KV head. A row x (one token's head_dim values of one KV head) is stored as
    scale = max|x| / 127 (float32),   q = round_half_even(x / scale) clamped to [-127, 127] (int8)
and read back as q * scale; an all-zero row has scale 0 and reads back as zeros. The round trip errs by at most
scale / 2 per element.

Page layout (one block id = one page of `page_bytes` bytes per layer; the block-id pool is the usual one):

    [ K int8: block_size x num_kv_heads x head_dim ][ V int8: same ][ pad to 4 ][ K scale f32: block_size x
      num_kv_heads ][ V scale f32: same ]

The layer's cache is a uint8 buffer [num_blocks, page_bytes] seen through two typed views (no copy), the
components 'data' and 'scales' of an interleaved KVPageLayout (attention/kv_page_layout.py):
- data   int8    [2, num_blocks, block_size, num_kv_heads, head_dim], strides (plane, page_bytes, H*D, D, 1);
- scales float32 [2, num_blocks, block_size, num_kv_heads] at byte offset `scale_offset` of every page.
The data view is what layers hold as `kv_cache` (its shape is the bf16 cache's, so block tables, slots and
validation are unchanged); the scale view is found from it (`kv_cache_scales`): attached to the tensor when the
cache is allocated, else rebuilt from its storage and page stride. Invariant: the scales of a token sit in the
same page as its K/V, so whatever moves, frees or shares a block id (prefix caching, preemption) moves its scales
too.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from pagedserve.attention.kv_page_layout import (
    KVCacheComponent,
    KVPageLayout,
    attach_kv_cache_components,
    kv_cache_components,
)

KV_SCALE_DTYPE = torch.float32
_INT8_MAX = 127.0


class _Int8Page:
    """What the int8 pages share: a KVPageLayout (`page_layout`) of an int8 'data' component and its float32
    'scales'."""

    page_layout: KVPageLayout

    @property
    def scale_offset(self) -> int:
        """Byte offset of the scales in a page (4-aligned, after the int8 data)."""
        return self.page_layout.offset("scales")

    @property
    def page_bytes(self) -> int:
        return self.page_layout.page_bytes

    def views(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(data, scales) views over `pages` uint8 [num_blocks, page_bytes]."""
        views = self.page_layout.views(pages)
        return views["data"], views["scales"]


@dataclass(frozen=True)
class Int8KVPageLayout(_Int8Page):
    """One int8 K/V page (see the module docstring): data int8 [2, nb, bs, H, D] and scales float32 [2, nb, bs, H]."""

    block_size: int
    num_kv_heads: int
    head_dim: int

    @cached_property
    def page_layout(self) -> KVPageLayout:
        return KVPageLayout.pack(self.block_size, (
            KVCacheComponent("data", torch.int8, (self.num_kv_heads, self.head_dim), leading_shape=(2,)),
            KVCacheComponent("scales", KV_SCALE_DTYPE, (self.num_kv_heads,), leading_shape=(2,))))

    @property
    def plane_bytes(self) -> int:
        """Bytes of one block's K (or V) int8 values."""
        return self.block_size * self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class Int8LatentPageLayout(_Int8Page):
    """One MLA latent page: int8 rows [block_size, kv_lora_rank + rope_dim] (data [nb, bs, width]), then (4-aligned)
    float32 scales [block_size, 2]: scale 0 for the compressed latent c (the first kv_lora_rank values), scale 1 for
    the rotary key k_pe (the rest). The two parts have unrelated magnitudes, so each gets its own scale."""

    block_size: int
    kv_lora_rank: int
    rope_dim: int

    @cached_property
    def page_layout(self) -> KVPageLayout:
        return KVPageLayout.pack(self.block_size, (KVCacheComponent("data", torch.int8, (self.width,)),
                                                   KVCacheComponent("scales", KV_SCALE_DTYPE, (2,))))

    @property
    def width(self) -> int:
        return self.kv_lora_rank + self.rope_dim


def quantize_latent(latent: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA latent rows [..., kv_lora_rank + rope] -> (int8 rows, float32 scales [..., 2]): c and k_pe each
    quantized as one row (quantize_per_token_head)."""
    parts = [quantize_per_token_head(part) for part in (latent[..., :kv_lora_rank], latent[..., kv_lora_rank:])]
    return (torch.cat([parts[0][0], parts[1][0]], dim=-1),
            torch.stack([parts[0][1], parts[1][1]], dim=-1))


def dequantize_latent(quantized: torch.Tensor, scales: torch.Tensor, kv_lora_rank: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of quantize_latent: [..., kv_lora_rank + rope] in `dtype` (computed in float32)."""
    values = torch.cat([dequantize(quantized[..., :kv_lora_rank], scales[..., 0]),
                        dequantize(quantized[..., kv_lora_rank:], scales[..., 1])], dim=-1)
    return values if dtype == torch.float32 else values.to(dtype)


def int8_page_layout(kv_cache: torch.Tensor) -> Int8KVPageLayout:
    """The page layout of an int8 data view [2, num_blocks, block_size, num_kv_heads, head_dim]."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return Int8KVPageLayout(block_size, num_kv_heads, head_dim)


def allocate_int8_kv_cache(num_blocks: int, layout: Int8KVPageLayout | Int8LatentPageLayout,
                           allocate_zeros) -> torch.Tensor:
    """Zeroed pages for `num_blocks` block ids; returns the data view with its scale view attached.
    `allocate_zeros(shape, dtype)` is the platform's allocator (Platform.allocate_zeros)."""
    return layout.page_layout.allocate(num_blocks, allocate_zeros)


def is_int8_kv_cache(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.int8


def kv_cache_scales(kv_cache: torch.Tensor) -> torch.Tensor:
    """The float32 scale view [2, num_blocks, block_size, num_kv_heads] of an int8 data view's pages."""
    scales = kv_cache_components(kv_cache).get("scales")
    if scales is not None:
        return scales
    if kv_cache.dim() != 5:
        raise ValueError(f"kv_cache (int8, shape {tuple(kv_cache.shape)}) has no attached scale view "
                         f"(allocate it with allocate_int8_kv_cache)")
    layout = int8_page_layout(kv_cache)
    if kv_cache.stride(1) != layout.page_bytes or kv_cache.stride(0) != layout.plane_bytes:
        raise ValueError(f"kv_cache (int8) is not a page view: block stride {kv_cache.stride(1)} != page bytes "
                         f"{layout.page_bytes} or plane stride {kv_cache.stride(0)} != {layout.plane_bytes}")
    pages = torch.empty(0, dtype=torch.uint8, device=kv_cache.device).set_(
        kv_cache.untyped_storage(), kv_cache.storage_offset(), (kv_cache.shape[1], layout.page_bytes))
    views = layout.page_layout.views(pages)
    attach_kv_cache_components(kv_cache, views)
    return views["scales"]


def quantize_per_token_head(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., head_dim] (any float dtype) -> (int8 [..., head_dim], float32 scales [...]); see the module
    docstring. The reference for the native write (bitwise)."""
    values = rows.float()
    scales = values.abs().amax(dim=-1) / _INT8_MAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    quantized = torch.round(values / safe[..., None]).clamp_(-_INT8_MAX, _INT8_MAX)
    return quantized.to(torch.int8), scales


def dequantize(quantized: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 [..., head_dim] with float32 scales [...] -> values [..., head_dim] in `dtype` (computed in float32)."""
    values = quantized.float() * scales[..., None]
    return values if dtype == torch.float32 else values.to(dtype)


def write_to_int8_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
    """Quantizes K/V rows [num_tokens, num_kv_heads, head_dim] into the int8 pages at the flat slots
    `slot_mapping` (block_id * block_size + offset), values and scales alike."""
    block_size = kv_cache.shape[2]
    slots = slot_mapping.to(torch.long)
    block_ids, offsets = slots // block_size, slots % block_size
    scales = kv_cache_scales(kv_cache)
    for plane, rows in ((0, key), (1, value)):
        quantized, row_scales = quantize_per_token_head(rows)
        kv_cache[plane].index_put_((block_ids, offsets), quantized)
        scales[plane].index_put_((block_ids, offsets), row_scales)


def gather_dequantized_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The blocks `block_ids` (int64) of an int8 cache, dequantized: [2, len(block_ids), block_size, H_kv, D].
    Reads only those pages (never the whole cache)."""
    data = kv_cache.index_select(1, block_ids)
    scales = kv_cache_scales(kv_cache).index_select(1, block_ids)
    return dequantize(data, scales, dtype)


def dequantize_kv_cache(kv_cache: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole int8 cache as a plain [2, num_blocks, block_size, H_kv, D] cache of `dtype` (tests' oracle)."""
    return dequantize(kv_cache, kv_cache_scales(kv_cache), dtype).contiguous()


__all__ = [
    "KV_SCALE_DTYPE",
    "Int8KVPageLayout",
    "Int8LatentPageLayout",
    "allocate_int8_kv_cache",
    "dequantize",
    "dequantize_kv_cache",
    "dequantize_latent",
    "gather_dequantized_blocks",
    "int8_page_layout",
    "is_int8_kv_cache",
    "kv_cache_scales",
    "quantize_latent",
    "quantize_per_token_head",
    "write_to_int8_kv_cache",
]
