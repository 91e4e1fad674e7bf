"""Sizing and allocating the paged KV cache (one tensor per attention layer)."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.config.cache import (DEFAULT_KV_CACHE_MAX_BYTES, DEFAULT_KV_CACHE_RAM_FRACTION,
                                     CacheConfig)
from pagedserve.platforms.interface import Platform


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The model's attention layers (modules holding a `kv_cache` and declaring a `kv_cache_spec()`), in
    layer order. Layers of different kinds (dense, MLA) may be mixed; each gets a cache of its own shape."""
    return [module for module in model.modules()
            if hasattr(module, "kv_cache") and callable(getattr(module, "kv_cache_spec", None))]


def kv_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block id costs over all layers (each layer per its own spec)."""
    return sum(layer.kv_cache_spec().bytes_per_block(block_size, dtype) for layer in attention_layers(model))


def determine_num_kv_blocks(cache_config: CacheConfig, bytes_per_block: int, available_bytes: int,
                            max_model_len: int, max_num_seqs: int) -> int:
    """Blocks from num_kv_blocks, else kv_cache_memory, else a share of available memory.

    The default never exceeds what max_num_seqs full-length sequences can use.

    Raises ValueError when the cache cannot hold one max_model_len sequence (naming both numbers).
    """
    block_size = cache_config.block_size
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
                       platform: Platform) -> list[torch.Tensor]:
    # Zero-filled: padded reads of unwritten slots (masked out by attention) must never see NaN.
    return [platform.allocate_zeros(layer.kv_cache_spec().tensor_shape(num_blocks, block_size), dtype)
            for layer in attention_layers(model)]
