"""KVPageRegions: gathering blocks from one cache and scattering them into another moves every component of those
blocks (interleaved and planar pages) and nothing else."""
from __future__ import annotations

import pytest
import torch

from pagedserve.attention.kv_page_layout import KVCacheComponent, KVPageLayout, kv_cache_components
from pagedserve.kv_transfer.kv_page_regions import KVPageRegions, signature_mismatches

NUM_BLOCKS = 12


def layout(is_interleaved: bool) -> KVPageLayout:
    return KVPageLayout.pack(4, [KVCacheComponent("kv", torch.int8, (2, 8), (2,)),
                                 KVCacheComponent("scale", torch.float32, (2,), (2,))],
                             is_interleaved=is_interleaved)


def random_cache(page_layout: KVPageLayout, seed: int) -> torch.Tensor:
    cache = page_layout.allocate(NUM_BLOCKS, lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    generator = torch.Generator().manual_seed(seed)
    for view in kv_cache_components(cache).values():
        view.copy_(torch.randint(-100, 100, view.shape, generator=generator).to(view.dtype))
    return cache


@pytest.mark.parametrize("is_interleaved", [True, False])
@pytest.mark.parametrize("source_ids, target_ids", [([3, 4, 5], [7, 8, 9]), ([9, 2, 6], [1, 10, 4])])
def test_gather_scatter_moves_every_component(is_interleaved: bool, source_ids: list[int],
                                              target_ids: list[int]) -> None:
    page_layout = layout(is_interleaved)
    source, target = random_cache(page_layout, 0), random_cache(page_layout, 1)
    before = {name: view.clone() for name, view in kv_cache_components(target).items()}
    source_regions = KVPageRegions.build({"layer": source}, {"layer": page_layout}, NUM_BLOCKS, {})
    target_regions = KVPageRegions.build({"layer": target}, {"layer": page_layout}, NUM_BLOCKS, {})
    target_regions.scatter(target_ids, [tensor.clone() for tensor in source_regions.gather(source_ids)])
    untouched = [block_id for block_id in range(NUM_BLOCKS) if block_id not in target_ids]
    for name, view in kv_cache_components(target).items():
        block_axis = len(page_layout.component(name).leading_shape)
        source_view = kv_cache_components(source)[name]
        assert torch.equal(view.index_select(block_axis, torch.tensor(target_ids)),
                           source_view.index_select(block_axis, torch.tensor(source_ids)))
        assert torch.equal(view.index_select(block_axis, torch.tensor(untouched)),
                           before[name].index_select(block_axis, torch.tensor(untouched)))


def test_signature_mismatch_names_both_sides() -> None:
    producer = {"block_size": 16, "dtype": "torch.float32", "layers": [["a", [64], ["kv"]]]}
    consumer = {"block_size": 32, "dtype": "torch.float32", "layers": [["a", [128], ["kv"]]]}
    assert signature_mismatches(consumer, producer) == [
        "block_size: producer 16, consumer 32",
        "layers: producer 1 layers (layer 0: producer ['a', [64], ['kv']], consumer ['a', [128], ['kv']]), "
        "consumer 1 layers"]
