"""The byte regions of a worker's KV pages that a block transfer moves, and the signature both sides compare.

A layer's cache is one uint8 buffer of pages (attention/kv_page_layout.py). Interleaved pages are one region
[num_blocks, page_bytes]; planar pages are one region per plane ([num_blocks, plane bytes] each, the page's
byte_ranges). Moving block b of every region of every layer moves everything block b holds: K and V, an MLA
latent, int8 scales, indexer keys. Two engines can exchange blocks only when their regions match one for one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.attention.kv_page_layout import KVPageLayout


@dataclass
class KVPageRegions:
    """Every layer's regions as [num_blocks, region bytes] uint8 views of the live cache (writes land in it)."""

    layer_names: list[str]
    regions: list[list[torch.Tensor]]
    # Compared at handshake: block size, dtypes, model and per-layer region sizes (see signature()).
    signature: dict[str, Any]

    @staticmethod
    def build(kv_caches: dict[str, torch.Tensor], page_layouts: dict[str, KVPageLayout], num_blocks: int,
              engine_signature: dict[str, Any]) -> "KVPageRegions":
        """`kv_caches`: each layer's allocated primary view of `num_blocks` pages; `page_layouts`: its layout."""
        names = list(kv_caches)
        regions = [_layer_regions(kv_caches[name], page_layouts[name], num_blocks) for name in names]
        signature = dict(engine_signature)
        signature["layers"] = [[name, [int(region.shape[1]) for region in layer_regions],
                                [f"{c.name}:{c.dtype}:{list(c.leading_shape)}:{list(c.per_token_shape)}"
                                 for c in page_layouts[name].components]]
                               for name, layer_regions in zip(names, regions)]
        return KVPageRegions(names, regions, signature)

    @property
    def num_blocks(self) -> int:
        return int(self.regions[0][0].shape[0]) if self.regions else 0

    def gather(self, block_ids: list[int]) -> list[torch.Tensor]:
        """The blocks' bytes, one contiguous [len(block_ids), region bytes] tensor per region: a view of the cache
        when the ids are consecutive (nothing copied; the caller keeps the blocks unchanged while it reads),
        else a copy."""
        runs = _consecutive_runs(block_ids)
        flat = [region for layer_regions in self.regions for region in layer_regions]
        if len(runs) == 1:
            _, first_block, length = runs[0]
            return [region[first_block:first_block + length] for region in flat]
        return [torch.cat([region[first_block:first_block + length] for _, first_block, length in runs])
                for region in flat]

    def region_bytes(self) -> list[int]:
        """Bytes one block has in each region, in gather() order."""
        return [int(region.shape[1]) for layer_regions in self.regions for region in layer_regions]

    def scatter(self, block_ids: list[int], sources: list[torch.Tensor]) -> None:
        """Write `sources` (gather()'s form) into the blocks `block_ids`."""
        # Runs of consecutive block ids are copied as slices: index_copy_ on byte rows is ~50x slower than memcpy.
        runs = _consecutive_runs(block_ids)
        flat = [region for layer_regions in self.regions for region in layer_regions]
        for region, source in zip(flat, sources, strict=True):
            for first_row, first_block, length in runs:
                region[first_block:first_block + length].copy_(source[first_row:first_row + length])


def _consecutive_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first row, first block id, length) of each run of consecutive ids in `block_ids`."""
    runs: list[tuple[int, int, int]] = []
    for row, block_id in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((row, block_id, 1))
    return runs


def _layer_regions(kv_cache: torch.Tensor, layout: KVPageLayout, num_blocks: int) -> list[torch.Tensor]:
    """The layer's page buffer, found from its primary view, cut into its regions."""
    # The primary view is the first component, which sits at byte 0 of the page (and of the planar buffer).
    if layout.offsets[0] != 0:
        raise ValueError(f"KV page layout puts its first component at byte {layout.offsets[0]}; the transfer "
                         f"expects byte 0")
    element_size = kv_cache.element_size()
    start = kv_cache.storage_offset() * element_size
    flat = torch.empty(0, dtype=torch.uint8, device=kv_cache.device).set_(
        kv_cache.untyped_storage(), start, (num_blocks * layout.page_bytes,))
    if layout.is_interleaved:
        return [flat.view(num_blocks, layout.page_bytes)]
    return [flat[num_blocks * begin:num_blocks * end].view(num_blocks, end - begin)
            for begin, end in layout.byte_ranges()]


def signature_mismatches(local: dict[str, Any], remote: dict[str, Any]) -> list[str]:
    """One line per differing key: 'key: producer X, consumer Y' (local is the consumer)."""
    lines = []
    for key in sorted(set(local) | set(remote)):
        if local.get(key) != remote.get(key):
            remote_value, local_value = remote.get(key), local.get(key)
            if key == "layers":
                remote_value = f"{len(remote_value or [])} layers {_first_difference(remote_value, local_value)}"
                local_value = f"{len(local_value or [])} layers"
            lines.append(f"{key}: producer {remote_value}, consumer {local_value}")
    return lines


def _first_difference(remote: Any, local: Any) -> str:
    for index, (remote_layer, local_layer) in enumerate(zip(remote or [], local or [])):
        if remote_layer != local_layer:
            return f"(layer {index}: producer {remote_layer}, consumer {local_layer})"
    return ""
