"""MLA with kv_cache_dtype="int8": the latent page (int8 rows, one float32 scale for c and one for k_pe), and
mla_paged_attention over it equal to the same attention over the dequantized latents (a float32 cache)."""
from __future__ import annotations

import random

import torch

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.kv_cache_spec import KVCacheSpec
from pagedserve.attention.kv_quantization import (
    Int8LatentPageLayout,
    allocate_int8_kv_cache,
    dequantize_latent,
    kv_cache_scales,
    quantize_latent,
)
from pagedserve.attention.mla_paged import mla_paged_attention, write_latent_to_cache

HEADS, NOPE, ROPE, V, RANK = 4, 16, 8, 12, 20


def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def test_latent_quantization_scales_c_and_k_pe_separately() -> None:
    generator = torch.Generator().manual_seed(0)
    latent = torch.cat([torch.randn(5, RANK, generator=generator) * 0.1,
                        torch.randn(5, ROPE, generator=generator) * 30], dim=-1)
    quantized, scales = quantize_latent(latent, RANK)
    assert quantized.shape == (5, RANK + ROPE) and scales.shape == (5, 2)
    torch.testing.assert_close(scales[:, 0], latent[:, :RANK].abs().amax(-1) / 127, rtol=0, atol=0)
    torch.testing.assert_close(scales[:, 1], latent[:, RANK:].abs().amax(-1) / 127, rtol=0, atol=0)
    error = (dequantize_latent(quantized, scales, RANK) - latent).abs()
    assert (error[:, :RANK] <= scales[:, :1] / 2 * (1 + 1e-5)).all()
    assert (error[:, RANK:] <= scales[:, 1:] / 2 * (1 + 1e-5)).all()


def test_latent_page_layout_and_spec() -> None:
    layout = Int8LatentPageLayout(block_size=16, kv_lora_rank=512, rope_dim=64)
    assert layout.page_bytes == 16 * 576 + 16 * 2 * 4
    spec = KVCacheSpec(per_token_shape=(576,), supports_int8=True, latent_rank=512)
    assert spec.int8_page_layout(16) == layout
    # DeepSeek's latent in bf16 (1152 bytes a token) -> 584: 1.97x the tokens.
    assert spec.bytes_per_block(16, torch.bfloat16) / spec.bytes_per_block(16, torch.bfloat16, "int8") > 1.95
    cache = allocate_int8_kv_cache(3, Int8LatentPageLayout(4, RANK, ROPE), _zeros)
    cache.fill_(7)
    assert kv_cache_scales(cache).abs().sum() == 0  # the data view never touches the scales


def test_mla_int8_attention_equals_attention_over_dequantized_latents() -> None:
    """Decodes (absorbed), a chunk over a cached prefix and a fresh prefill (expanded), int8 vs float32 holding
    the dequantized latents."""
    generator = torch.Generator().manual_seed(1)
    kv_b = torch.randn(HEADS * (NOPE + V), RANK, generator=generator) * 0.3
    block_size, num_blocks = 4, 40
    schedule = [(7, 1), (12, 1), (9, 5), (0, 6)]  # (cached, new) per request
    ids = list(range(1, num_blocks))
    random.Random(1).shuffle(ids)
    tables, slots_of = [], []
    for cached, new in schedule:
        count = -(-(cached + new) // block_size)
        tables.append(ids[:count])
        ids = ids[count:]
        slots_of.append([tables[-1][p // block_size] * block_size + p % block_size for p in range(cached + new)])
    int8_cache = allocate_int8_kv_cache(num_blocks, Int8LatentPageLayout(block_size, RANK, ROPE), _zeros)
    for (cached, _), slots in zip(schedule, slots_of):
        if cached:
            history = torch.randn(cached, RANK + ROPE, generator=generator) * 2
            write_latent_to_cache(history, int8_cache, torch.tensor(slots[:cached]), RANK)
    starts, step_slots = [0], []
    for (cached, new), slots in zip(schedule, slots_of):
        starts.append(starts[-1] + new)
        step_slots += slots[cached:]
    seq_lens = [cached + new for cached, new in schedule]
    width = max(len(t) for t in tables)
    metadata = AttentionMetadata(
        num_actual_tokens=starts[-1], slot_mapping=torch.tensor(step_slots), query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=6, max_seq_len=max(seq_lens), num_decodes=2, num_decode_tokens=2, query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens, block_size=block_size)
    num_tokens = starts[-1]
    q_nope = torch.randn(num_tokens, HEADS, NOPE, generator=generator)
    q_pe = torch.randn(num_tokens, HEADS, ROPE, generator=generator)
    latent = torch.randn(num_tokens, RANK + ROPE, generator=generator) * 2
    output = mla_paged_attention(q_nope, q_pe, latent, int8_cache, metadata, kv_b, RANK, V, 0.3)
    # The oracle: the int8 cache (now holding the step's latents too) dequantized into a float32 cache.
    dense = dequantize_latent(int8_cache, kv_cache_scales(int8_cache), RANK).contiguous()
    new_latent = dense.view(-1, RANK + ROPE)[metadata.slot_mapping]
    reference = mla_paged_attention(q_nope, q_pe, new_latent, dense.clone(), metadata, kv_b, RANK, V, 0.3)
    torch.testing.assert_close(output, reference, rtol=1e-5, atol=1e-5)
    unquantized_cache = dense.clone()
    unquantized = mla_paged_attention(q_nope, q_pe, latent, unquantized_cache, metadata, kv_b, RANK, V, 0.3)
    relative = ((output - unquantized).abs().max() / unquantized.abs().max()).item()
    assert 1e-5 < relative < 0.03  # the new tokens' own latents are quantized too
