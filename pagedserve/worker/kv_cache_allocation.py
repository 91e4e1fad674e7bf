"""Sizing and allocating the paged KV cache (one byte buffer per attention layer, seen through the typed views of
its spec's page layout: attention/kv_page_layout.py).

kv_cache_dtype="auto" gives each layer one tensor of the model's dtype; "int8" gives each dense attention layer
byte pages holding int8 K/V and their per-token-per-head scales (attention/kv_quantization.py), sized by those
pages' bytes, so the same memory holds about twice the tokens of a bfloat16 cache (four times float32's, less
the scales); MLA layers get int8 latent pages, DeepSeek sparse attention layers the C8 page
(attention/sparse_int8_cache.py). Layers that cannot read such pages (the block drafter) are refused at start."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.config.cache import (
    DEFAULT_KV_CACHE_MAX_BYTES,
    DEFAULT_KV_CACHE_RAM_FRACTION,
    CacheConfig,
)
from pagedserve.platforms.interface import Platform


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The model's attention layers (modules holding a `kv_cache` and declaring a `kv_cache_spec()`), in
    layer order. Layers of different kinds (dense, MLA) may be mixed; each gets a cache of its own shape."""
    return [module for module in model.modules()
            if hasattr(module, "kv_cache") and callable(getattr(module, "kv_cache_spec", None))]


def check_kv_cache_dtype(model: nn.Module, kv_cache_dtype: str) -> None:
    """ValueError naming kv_cache_dtype when a layer of `model` cannot serve it (int8 with a block drafter)."""
    if kv_cache_dtype == "auto":
        return
    for module_name, module in model.named_modules():
        if hasattr(module, "kv_cache") and callable(getattr(module, "kv_cache_spec", None)) \
                and not module.kv_cache_spec().supports_int8:
            kind = type(module).__name__
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported for {kind} layers yet (layer "
                             f"{module_name or kind}); use kv_cache_dtype='auto'")


def kv_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes one block id costs over all layers (each layer per its own spec and the cache dtype)."""
    check_kv_cache_dtype(model, kv_cache_dtype)
    return sum(layer.kv_cache_spec().bytes_per_block(block_size, dtype, kv_cache_dtype)
               for layer in attention_layers(model))


def determine_num_kv_blocks(cache_config: CacheConfig, bytes_per_block: int, available_bytes: int,
                            max_model_len: int, max_num_seqs: int, tokens_per_block: int | None = None) -> int:
    """Blocks from num_kv_blocks, else kv_cache_memory, else a share of available memory.

    The default never exceeds what max_num_seqs full-length sequences can use. A block id covers
    `tokens_per_block` positions (default block_size; more when decode context parallel splits them over ranks).

    Raises ValueError when the cache cannot hold one max_model_len sequence (naming both numbers).
    """
    block_size = tokens_per_block or cache_config.block_size
    if cache_config.num_kv_blocks is not None:
        num_blocks = cache_config.num_kv_blocks
        source = f"num_kv_blocks={num_blocks}"
    else:
        budget = cache_config.kv_cache_memory
        if budget is None:
            budget = min(int(available_bytes * DEFAULT_KV_CACHE_RAM_FRACTION), DEFAULT_KV_CACHE_MAX_BYTES)
            useful_blocks = max_num_seqs * -(-max_model_len // block_size) + 1
            budget = min(budget, useful_blocks * bytes_per_block)
        num_blocks = max(budget // bytes_per_block, 0)
        source = f"kv_cache_memory={budget} bytes ({bytes_per_block} bytes per block)"
    # Block 0 is the null block; a sequence of max_model_len tokens needs this many others.
    needed = -(-max_model_len // block_size) + 1
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache ({source}) holds {max(num_blocks - 1, 0) * block_size} tokens, fewer than "
            f"max_model_len={max_model_len}: give more kv_cache_memory / num_kv_blocks (>= {needed}) "
            f"or a smaller max_model_len"
        )
    return int(num_blocks)


def allocate_kv_caches(model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                       platform: Platform, kv_cache_dtype: str = "auto") -> list[torch.Tensor]:
    """One cache per attention layer: one byte buffer of `num_blocks` pages laid out by the layer's spec
    (KVCacheSpec.page_layout), returned as its first component's view (the `dtype` K/V or latent of the spec's
    shape, or the int8 data view) with every component's view attached (kv_page_layout.kv_cache_component)."""
    check_kv_cache_dtype(model, kv_cache_dtype)
    # Zero-filled: padded reads of unwritten slots (masked out by attention) must never see NaN.
    return [layer.kv_cache_spec().page_layout(block_size, dtype, kv_cache_dtype).allocate(num_blocks,
                                                                                          platform.allocate_zeros)
            for layer in attention_layers(model)]
