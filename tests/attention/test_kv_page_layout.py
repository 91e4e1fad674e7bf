"""Multi-component KV pages (attention/kv_page_layout.py): on random layouts, in both arrangements, the component
views never overlap, a write through one component never changes another, block ids are isolated (within a buffer
and between layers' buffers), and a page written through the views equals the torch.cat packing of its components.
The same holds for the C8 pages of DeepSeek sparse attention (attention/sparse_int8_cache.py). The existing specs
(dense K/V, MLA latent, int8 pages) keep their shapes, sizes and memory order."""
from __future__ import annotations

import random

import pytest
import torch

from pagedserve.attention.kv_cache_spec import ExtraKVComponent, KVCacheSpec
from pagedserve.attention.kv_page_layout import (
    KVCacheComponent,
    KVPageLayout,
    kv_cache_component,
)
from pagedserve.attention.kv_quantization import Int8KVPageLayout, Int8LatentPageLayout
from pagedserve.attention.sparse_int8_cache import SparseInt8PageLayout

DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.float16, torch.uint8, torch.int32)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def _random_layout(rng: random.Random, is_interleaved: bool) -> KVPageLayout:
    components = []
    for index in range(rng.randint(1, 4)):
        leading = rng.choice([(), (2,), (3,), (2, 2)])
        per_token = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 2)))
        components.append(KVCacheComponent(f"c{index}", rng.choice(DTYPES), per_token, leading))
    return KVPageLayout.pack(rng.choice([1, 3, 4, 16]), components, is_interleaved=is_interleaved)


def _random_values(view: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if view.dtype.is_floating_point:
        return (torch.randn(view.shape, generator=generator) * 3 + 1).to(view.dtype)
    info = torch.iinfo(view.dtype)
    # Never zero, so that a written element always differs from the zeroed buffer.
    values = torch.randint(1, min(info.max, 100), view.shape, generator=generator)
    return values.to(view.dtype)


def _byte_addresses(view: torch.Tensor) -> torch.Tensor:
    """The storage byte offsets every element of `view` covers."""
    size = view.element_size()
    num_elements = view.untyped_storage().nbytes() // size
    element_ids = torch.arange(num_elements).as_strided(view.shape, view.stride(), view.storage_offset())
    return (element_ids.reshape(-1, 1) * size + torch.arange(size)).reshape(-1)


CASES = [(seed, is_interleaved) for seed in range(12) for is_interleaved in (True, False)]
# C8 pages: the tiny test models' (rank 16, rope 8, index keys 16), one with two latent tiles, one without an indexer.
C8_LAYOUTS = [SparseInt8PageLayout(4, 16, 8, 16), SparseInt8PageLayout(3, 256, 64, 32),
              SparseInt8PageLayout(4, 16, 8, None)]
C8_CASES = [pytest.param(seed, layout.page_layout, id=f"c8-{seed}") for seed, layout in enumerate(C8_LAYOUTS)]


def test_pack_aligns_each_component_and_the_page() -> None:
    layout = KVPageLayout.pack(1, (KVCacheComponent("a", torch.int8, (3,)), KVCacheComponent("b", torch.float32, (1,)),
                                   KVCacheComponent("c", torch.int8, (1,))))
    assert layout.offsets == (0, 4, 8) and layout.page_bytes == 12
    assert layout.byte_ranges() == [(0, 3), (3, 4), (4, 8), (8, 9), (9, 12)]


@pytest.mark.parametrize("seed,is_interleaved", CASES)
def test_views_tile_the_pages_without_overlap(seed: int, is_interleaved: bool) -> None:
    _check_views_tile_the_pages_without_overlap(_random_layout(random.Random(seed), is_interleaved))


@pytest.mark.parametrize("seed,layout", C8_CASES)
def test_c8_views_tile_the_pages_without_overlap(seed: int, layout: KVPageLayout) -> None:
    _check_views_tile_the_pages_without_overlap(layout)


def _check_views_tile_the_pages_without_overlap(layout: KVPageLayout) -> None:
    num_blocks = 5
    buffer = torch.zeros(num_blocks, layout.page_bytes, dtype=torch.uint8)
    views = layout.views(buffer)
    coverage = torch.zeros(buffer.numel(), dtype=torch.long)
    for component in layout.components:
        view = views[component.name]
        assert view.shape == (*component.leading_shape, num_blocks, layout.block_size, *component.per_token_shape)
        assert view.dtype == component.dtype
        coverage += torch.bincount(_byte_addresses(view), minlength=buffer.numel())
    assert int(coverage.max()) == 1  # no byte belongs to two components (or twice to one)
    assert int(coverage.sum()) == num_blocks * sum(c.page_bytes(layout.block_size) for c in layout.components)
    assert layout.page_bytes % layout.alignment == 0
    for component, offset in zip(layout.components, layout.offsets):
        assert offset % component.element_size == 0


@pytest.mark.parametrize("seed,is_interleaved", CASES)
def test_writes_stay_in_their_component_and_block(seed: int, is_interleaved: bool) -> None:
    _check_writes_stay_in_their_component_and_block(_random_layout(random.Random(seed), is_interleaved), seed)


@pytest.mark.parametrize("seed,layout", C8_CASES)
def test_c8_writes_stay_in_their_component_and_block(seed: int, layout: KVPageLayout) -> None:
    _check_writes_stay_in_their_component_and_block(layout, seed)


def _check_writes_stay_in_their_component_and_block(layout: KVPageLayout, seed: int) -> None:
    num_blocks = 4
    buffer = torch.zeros(num_blocks, layout.page_bytes, dtype=torch.uint8)
    views = layout.views(buffer)
    generator = torch.Generator().manual_seed(seed)
    for written in layout.components:
        for block_id in range(num_blocks):
            buffer.zero_()
            view = views[written.name]
            block = view[(slice(None),) * len(written.leading_shape) + (block_id,)]
            block.copy_(_random_values(block, generator))
            for component in layout.components:
                other = views[component.name]
                expect_nonzero = component.name == written.name
                for other_block in range(num_blocks):
                    part = other[(slice(None),) * len(component.leading_shape) + (other_block,)]
                    is_written = expect_nonzero and other_block == block_id
                    assert bool((part != 0).all()) if is_written else not bool((part != 0).any()), \
                        (written.name, block_id, component.name, other_block)
            # Only block_id's page holds nonzero bytes.
            for other_block in range(num_blocks):
                page = layout.page(buffer, other_block)
                assert bool(page.any()) == (other_block == block_id)


@pytest.mark.parametrize("seed,is_interleaved", CASES)
def test_page_round_trip_equals_cat_packing(seed: int, is_interleaved: bool) -> None:
    _check_page_round_trip_equals_cat_packing(_random_layout(random.Random(seed), is_interleaved), seed)


@pytest.mark.parametrize("seed,layout", C8_CASES)
def test_c8_page_round_trip_equals_cat_packing(seed: int, layout: KVPageLayout) -> None:
    _check_page_round_trip_equals_cat_packing(layout, seed)


def _check_page_round_trip_equals_cat_packing(layout: KVPageLayout, seed: int) -> None:
    num_blocks = 3
    buffer = torch.zeros(num_blocks, layout.page_bytes, dtype=torch.uint8)
    views = layout.views(buffer)
    generator = torch.Generator().manual_seed(100 + seed)
    block_id = 1
    written = {}
    for component in layout.components:
        view = views[component.name]
        block = view[(slice(None),) * len(component.leading_shape) + (block_id,)]
        written[component.name] = _random_values(block, generator)
        block.copy_(written[component.name])
    # The expected page: each component's values (planes in order) as bytes at its offset, zero padding between.
    pieces = []
    cursor = 0
    for component, offset in zip(layout.components, layout.offsets):
        pieces.append(torch.zeros(offset - cursor, dtype=torch.uint8))
        pieces.append(written[component.name].contiguous().view(-1).view(torch.uint8))
        cursor = offset + component.page_bytes(layout.block_size)
    pieces.append(torch.zeros(layout.page_bytes - cursor, dtype=torch.uint8))
    assert torch.equal(layout.page(buffer, block_id), torch.cat(pieces))
    for component in layout.components:  # and the views read back what was written
        view = views[component.name]
        assert torch.equal(view[(slice(None),) * len(component.leading_shape) + (block_id,)], written[component.name])


def test_buffers_that_start_inside_their_storage() -> None:
    layout = KVPageLayout.pack(4, (KVCacheComponent("a", torch.int8, (3,)), KVCacheComponent("b", torch.float32, (2,))))
    start = 64

    def allocate_inside(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(start + shape[0] * shape[1], dtype=dtype)[start:].view(shape)

    primary = layout.allocate(6, allocate_inside)
    scales = kv_cache_component(primary, "b")
    assert primary.storage_offset() == start and scales.data_ptr() - primary.data_ptr() == layout.offset("b")
    primary.fill_(-1)
    assert not scales.any()
    with pytest.raises(ValueError, match="multiple of 4"):
        layout.views(torch.zeros(6 * layout.page_bytes + 2, dtype=torch.uint8)[2:].view(6, layout.page_bytes))
    with pytest.raises(KeyError, match="no component 'c'"):
        kv_cache_component(primary, "c")


def test_existing_specs_keep_their_shapes_sizes_and_memory_order() -> None:
    block_size, num_blocks = 16, 7
    dense = KVCacheSpec(per_token_shape=(2, 8), leading_shape=(2,), supports_int8=True)
    cache = dense.page_layout(block_size, torch.bfloat16).allocate(num_blocks, _zeros)
    # The plain contiguous [2, num_blocks, block_size, H, D] tensor the native kernels read.
    assert cache.shape == dense.tensor_shape(num_blocks, block_size) and cache.is_contiguous()
    assert cache.dtype == torch.bfloat16
    assert dense.bytes_per_block(block_size, torch.bfloat16) == block_size * 2 * 2 * 8 * 2
    mla = KVCacheSpec(per_token_shape=(24,), supports_int8=True, latent_rank=16)
    latent = mla.page_layout(block_size, torch.float32).allocate(num_blocks, _zeros)
    assert latent.shape == (num_blocks, block_size, 24) and latent.is_contiguous()
    # int8 pages: the same offsets and sizes as before the generic layout.
    kv_layout = Int8KVPageLayout(block_size, 2, 8)
    assert (kv_layout.scale_offset, kv_layout.page_bytes) == (2 * block_size * 16, 2 * block_size * 16 + 2 * block_size * 2 * 4)
    assert dense.page_layout(block_size, torch.float32, "int8") == kv_layout.page_layout
    latent_layout = Int8LatentPageLayout(block_size, 16, 8)
    assert (latent_layout.scale_offset, latent_layout.page_bytes) == (block_size * 24, block_size * 24 + block_size * 8)


def test_a_spec_with_an_extra_component_shares_the_page() -> None:
    block_size, num_blocks = 4, 5
    spec = KVCacheSpec(per_token_shape=(24,), latent_rank=16, extra_components=(ExtraKVComponent("index_key", (8,)),))
    layout = spec.page_layout(block_size, torch.float32)
    assert layout.is_interleaved and layout.page_bytes == block_size * (24 + 8) * 4
    assert spec.bytes_per_block(block_size, torch.float32) == layout.page_bytes
    latent = layout.allocate(num_blocks, _zeros)
    keys = kv_cache_component(latent, "index_key")
    assert latent.shape == (num_blocks, block_size, 24) and keys.shape == (num_blocks, block_size, 8)
    # One block id: its latent rows and its index keys are one contiguous page.
    assert keys[3].data_ptr() - latent[3].data_ptr() == block_size * 24 * 4
    assert latent[3].data_ptr() - latent[2].data_ptr() == layout.page_bytes
    with pytest.raises(ValueError, match="extra cache components"):
        spec.page_layout(block_size, torch.float32, "int8")
