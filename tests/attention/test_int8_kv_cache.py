"""The int8 KV cache (kv_cache_dtype="int8"): quantization, the page layout, and torch_paged reading int8 pages.

The oracle for attention is plain PyTorch: dequantize the whole cache into an ordinary float32 cache, then
reference_paged_attention over it. The backend must agree to float32 rounding, while differing measurably from
attention over the unquantized K/V (so the comparison really sees the quantized values).
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.kv_cache_spec import KVCacheSpec
from pagedserve.attention.kv_quantization import (
    Int8KVPageLayout,
    allocate_int8_kv_cache,
    dequantize,
    dequantize_kv_cache,
    kv_cache_scales,
    quantize_per_token_head,
    write_to_int8_kv_cache,
)
from pagedserve.attention.torch_paged import (
    TorchPagedAttentionBackend,
    reference_paged_attention,
    write_to_kv_cache,
)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def test_quantize_round_trip_error_at_most_half_a_step() -> None:
    rows = torch.randn(64, 4, 32, generator=torch.Generator().manual_seed(0)) * torch.rand(64, 4, 1) * 10
    quantized, scales = quantize_per_token_head(rows)
    assert quantized.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (64, 4)
    torch.testing.assert_close(scales, rows.abs().amax(-1) / 127, rtol=0, atol=0)
    # The row's largest magnitude maps to +-127 exactly; nothing leaves [-127, 127].
    assert (quantized.abs().amax(-1) == 127).all()
    error = (dequantize(quantized, scales) - rows).abs()
    assert (error <= scales[..., None] / 2 * (1 + 1e-5)).all()
    assert error.max() > 0  # real rounding happened


def test_quantize_zero_row_and_bfloat16_input() -> None:
    rows = torch.zeros(2, 1, 8)
    rows[1, 0, 3] = -2.5
    quantized, scales = quantize_per_token_head(rows.to(torch.bfloat16))
    assert torch.equal(scales, torch.tensor([[0.0], [2.5]]) / 127)
    assert quantized[0].abs().sum() == 0 and quantized[1, 0, 3] == -127
    assert torch.equal(dequantize(quantized, scales)[0], torch.zeros(1, 8))


def test_page_layout_bytes_and_capacity_ratio() -> None:
    layout = Int8KVPageLayout(block_size=16, num_kv_heads=8, head_dim=128)
    assert layout.plane_bytes == 16 * 8 * 128
    assert layout.scale_offset == 2 * layout.plane_bytes
    assert layout.page_bytes == 2 * 16 * 8 * (128 + 4)
    spec = KVCacheSpec(per_token_shape=(8, 128), leading_shape=(2,), supports_int8=True)
    assert spec.bytes_per_block(16, torch.float32, "int8") == layout.page_bytes
    bf16_bytes = spec.bytes_per_block(16, torch.bfloat16)
    # bf16 -> int8 + float32 scales: 256 / 132 = 1.94x the tokens per byte at head_dim 128 (3.88x for float32).
    assert bf16_bytes / layout.page_bytes == pytest.approx(512 / 264)
    assert spec.bytes_per_block(16, torch.float32) / layout.page_bytes == pytest.approx(1024 / 264)
    # An odd plane is padded so that the scales stay 4-aligned.
    odd = Int8KVPageLayout(block_size=1, num_kv_heads=1, head_dim=3)
    assert odd.scale_offset == 8 and odd.page_bytes == 16
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        KVCacheSpec(per_token_shape=(24,)).bytes_per_block(16, torch.float32, "int8")


def test_page_views_do_not_overlap_and_scales_live_in_their_page() -> None:
    layout = Int8KVPageLayout(block_size=4, num_kv_heads=2, head_dim=6)
    cache = allocate_int8_kv_cache(5, layout, _zeros)
    scales = kv_cache_scales(cache)
    pages = torch.empty(0, dtype=torch.uint8).set_(cache.untyped_storage(), 0, (5, layout.page_bytes))
    cache.fill_(-1)  # every int8 value
    assert torch.equal(scales, torch.zeros_like(scales))  # untouched by the data writes
    assert (pages[:, :2 * layout.plane_bytes] == 255).all() and (pages[:, layout.scale_offset:] == 0).all()
    scales[1, 3, 2, 1] = 1.0  # V scale of block 3, offset 2, head 1
    page = pages[3]
    offset = layout.scale_offset + (4 * 2 + 2 * 2 + 1) * 4
    assert torch.equal(page[offset:offset + 4].view(torch.float32), torch.tensor([1.0]))
    assert (pages[torch.tensor([0, 1, 2, 4]), layout.scale_offset:] == 0).all()
    # The scale view rebuilt from the storage (a cache without the attached view) is the same view.
    bare = cache.as_strided(cache.shape, cache.stride())
    rebuilt = kv_cache_scales(bare)
    assert rebuilt.data_ptr() == scales.data_ptr() and rebuilt.stride() == scales.stride()


@pytest.mark.parametrize("start", [0, 4096, 2 << 20])
def test_page_views_of_pages_that_start_inside_their_storage(start: int) -> None:
    """The huge-page allocator hands out pages aligned inside a bigger mapping: the views must add that offset
    (a scale view at the storage's byte 0 would overlay other pages' K/V once the cache outgrows the offset)."""
    layout = Int8KVPageLayout(block_size=16, num_kv_heads=3, head_dim=64)
    num_blocks = 400  # ~5 MiB of pages: past the 2 MiB offset

    def allocate_inside(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(start + shape[0] * shape[1], dtype=dtype)[start:].view(shape)

    cache = allocate_int8_kv_cache(num_blocks, layout, allocate_inside)
    scales = kv_cache_scales(cache)
    assert cache.storage_offset() == start
    assert scales.data_ptr() - cache.data_ptr() == layout.scale_offset
    assert scales[1, 7].data_ptr() - cache[0, 7].data_ptr() == layout.scale_offset + 16 * 3 * 4
    cache.fill_(-1)
    assert scales.abs().sum() == 0
    scales.fill_(1.0)
    assert (cache == -1).all()
    rebuilt = kv_cache_scales(cache.as_strided(cache.shape, cache.stride()))
    assert rebuilt.data_ptr() == scales.data_ptr() and rebuilt.stride() == scales.stride()


def test_platform_allocated_pages_round_trip() -> None:
    from pagedserve.platforms import current_platform

    layout = Int8KVPageLayout(block_size=16, num_kv_heads=3, head_dim=64)
    cache = allocate_int8_kv_cache(400, layout, current_platform().allocate_zeros)
    generator = torch.Generator().manual_seed(2)
    key, value = torch.randn(6000, 3, 64, generator=generator), torch.randn(6000, 3, 64, generator=generator)
    slots = torch.randperm(399 * 16, generator=generator)[:6000] + 16
    write_to_int8_kv_cache(key, value, cache, slots)
    dense = dequantize_kv_cache(cache).view(2, -1, 3, 64)
    assert dense.isfinite().all()
    torch.testing.assert_close(dense[0, slots], key, atol=0.02, rtol=0)
    torch.testing.assert_close(dense[1, slots], value, atol=0.02, rtol=0)


def test_write_places_values_and_scales_at_slots() -> None:
    layout = Int8KVPageLayout(block_size=4, num_kv_heads=2, head_dim=8)
    cache = allocate_int8_kv_cache(6, layout, _zeros)
    generator = torch.Generator().manual_seed(1)
    key, value = torch.randn(3, 2, 8, generator=generator), torch.randn(3, 2, 8, generator=generator)
    slots = torch.tensor([5 * 4 + 3, 1 * 4 + 0, 2 * 4 + 1])
    write_to_int8_kv_cache(key, value, cache, slots)
    dense = dequantize_kv_cache(cache)
    for index, slot in enumerate(slots.tolist()):
        for plane, rows in ((0, key), (1, value)):
            quantized, row_scales = quantize_per_token_head(rows[index])
            assert torch.equal(cache[plane, slot // 4, slot % 4], quantized)
            assert torch.equal(kv_cache_scales(cache)[plane, slot // 4, slot % 4], row_scales)
            assert torch.allclose(dense[plane, slot // 4, slot % 4], rows[index], atol=row_scales.max().item())
    written = {(slot // 4, slot % 4) for slot in slots.tolist()}
    for block in range(6):
        for offset in range(4):
            if (block, offset) not in written:
                assert cache[:, block, offset].abs().sum() == 0


def _metadata(schedule: list[tuple[int, int]], tables: list[list[int]], block_size: int) -> AttentionMetadata:
    """schedule: (num_computed, num_new) per request, decodes (num_new == 1) first."""
    starts, seq_lens, slots = [0], [], []
    for (computed, new), blocks in zip(schedule, tables):
        starts.append(starts[-1] + new)
        seq_lens.append(computed + new)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(computed, computed + new)]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    num_decodes = 0
    while num_decodes < len(schedule) and schedule[num_decodes][1] == 1:
        num_decodes += 1
    return AttentionMetadata(
        num_actual_tokens=starts[-1], slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table, max_query_len=max(n for _, n in schedule),
        max_seq_len=max(seq_lens), num_decodes=num_decodes, num_decode_tokens=num_decodes, query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens, block_size=block_size)


def paged_case(schedule: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                   AttentionMetadata]:
    """An int8 cache holding every request's computed tokens (random K/V, shuffled block ids), plus the step's
    query / new K / new V [num_tokens, heads, head_dim] float32 and its metadata; also returns a float32 cache with
    the same unquantized history. Returns (int8 cache, float cache, query, key, value, metadata)."""
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(computed + new) // block_size) for computed, new in schedule]
    num_blocks = sum(blocks_needed) + 3
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    tables = []
    for count in blocks_needed:
        tables.append(ids[:count])
        ids = ids[count:]
    layout = Int8KVPageLayout(block_size, num_kv_heads, head_dim)
    int8_cache = allocate_int8_kv_cache(num_blocks, layout, _zeros)
    float_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
    for (computed, _), blocks in zip(schedule, tables):
        if computed:
            history = _metadata([(0, computed)], [blocks], block_size)
            # Per-token magnitudes vary over 10x, as real K/V do: each row's own scale matters.
            magnitude = torch.rand(computed, num_kv_heads, 1, generator=generator) * 3 + 0.3
            key = torch.randn(computed, num_kv_heads, head_dim, generator=generator) * magnitude
            value = torch.randn(computed, num_kv_heads, head_dim, generator=generator) * magnitude
            write_to_kv_cache(key, value, int8_cache, history.slot_mapping)
            write_to_kv_cache(key, value, float_cache, history.slot_mapping)
    metadata = _metadata(schedule, tables, block_size)
    num_tokens = metadata.num_actual_tokens
    query = torch.randn(num_tokens, num_heads, head_dim, generator=generator)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator) * 2
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator) * 2
    return int8_cache, float_cache, query, key, value, metadata


def dequantized_reference(int8_cache: torch.Tensor, query: torch.Tensor, metadata: AttentionMetadata, scale: float,
                          sliding_window: int | None = None) -> torch.Tensor:
    """Dequantize-then-attend: the whole int8 cache (already holding the step's K/V) as a float32 cache, and
    reference_paged_attention over it (its write puts the dequantized new rows back unchanged)."""
    dense = dequantize_kv_cache(int8_cache)
    block_size = int8_cache.shape[2]
    slots = metadata.slot_mapping
    flat = dense.view(2, -1, *dense.shape[3:])
    key, value = flat[0, slots], flat[1, slots]
    assert block_size == metadata.block_size
    return reference_paged_attention(query, key, value, dense.clone(), metadata, scale, sliding_window)


# (num_computed, num_new) per request: decodes first, then a prefill with a cached prefix and a fresh prefill.
SCHEDULE = [(37, 1), (5, 1), (70, 1), (12, 9), (0, 14)]


@pytest.mark.parametrize("sliding_window", [None, 9])
def test_torch_paged_int8_equals_dequantize_then_attend(sliding_window: int | None) -> None:
    int8_cache, float_cache, query, key, value, metadata = paged_case(SCHEDULE, 4, 2, 16, 4, seed=3)
    scale = 1 / math.sqrt(16)
    output = TorchPagedAttentionBackend().forward(query, key, value, int8_cache, metadata, scale, sliding_window)
    reference = dequantized_reference(int8_cache, query, metadata, scale, sliding_window)
    torch.testing.assert_close(output, reference, rtol=1e-5, atol=1e-5)
    # The unquantized cache gives a measurably different answer (the comparison above sees the int8 values),
    # and not a wildly different one (the scales are right).
    unquantized = TorchPagedAttentionBackend().forward(query, key, value, float_cache, metadata, scale,
                                                       sliding_window)
    relative = ((output - unquantized).abs().max() / unquantized.abs().max()).item()
    assert 1e-5 < relative < 0.02


def test_torch_paged_int8_with_a_wrong_scale_fails_the_reference() -> None:
    """The check above catches a broken scale: the same step with the scales doubled after the write is far off."""
    int8_cache, float_cache, query, key, value, metadata = paged_case(SCHEDULE, 4, 2, 16, 4, seed=3)
    scale = 1 / math.sqrt(16)
    reference = TorchPagedAttentionBackend().forward(query, key, value, float_cache, metadata, scale)
    backend = TorchPagedAttentionBackend()
    write_to_kv_cache(key, value, int8_cache, metadata.slot_mapping)
    kv_cache_scales(int8_cache).mul_(2)  # every token's scale wrong by 2x
    broken = backend.forward(query, key * 2, value * 2, int8_cache, metadata, scale)
    assert ((broken - reference).abs().max() / reference.abs().max()).item() > 0.1


def test_torch_paged_int8_bfloat16_query() -> None:
    int8_cache, _, query, key, value, metadata = paged_case(SCHEDULE, 4, 2, 16, 4, seed=4)
    scale = 1 / math.sqrt(16)
    output = TorchPagedAttentionBackend().forward(query.bfloat16(), key.bfloat16(), value.bfloat16(), int8_cache,
                                                  metadata, scale)
    assert output.dtype == torch.bfloat16
    reference = dequantized_reference(int8_cache, query.bfloat16().float(), metadata, scale)
    torch.testing.assert_close(output.float(), reference, rtol=2e-2, atol=2e-2)
