"""The byte regions of a worker's KV pages that a block transfer moves, and the signature both sides compare.

A layer's cache is one uint8 buffer of pages (attention/kv_page_layout.py). Interleaved pages are one region
[num_blocks, page_bytes]; planar pages are one region per plane ([num_blocks, plane bytes] each, the page's
byte_ranges). Moving block b of every region of every layer moves everything block b holds: K and V, an MLA
latent, int8 scales, indexer keys. Two engines can exchange blocks only when their regions match one for one, or,
for a dense K/V layer split over TP ranks differently, when their pages differ only in the number of KV heads
(the consumer then copies head slices through typed views: copy_heads).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from pagedserve.attention.kv_page_layout import KVPageLayout


@dataclass
class KVPageRegions:
    """Every layer's regions as [num_blocks, region bytes] uint8 views of the live cache (writes land in it)."""

    layer_names: list[str]
    regions: list[list[torch.Tensor]]
    # Compared at handshake: block size, dtypes, model, this rank's placement (tp / pp rank and size) and per
    # layer [name, region sizes, components, KV head interval or None] (kv_pull_plan.py pairs the layers).
    signature: dict[str, Any]
    layouts: list[KVPageLayout]
    # Each layer's pages as one uint8 [num_blocks, page_bytes] buffer (the layouts' typed views take it).
    buffers: list[torch.Tensor]

    @staticmethod
    def build(kv_caches: dict[str, torch.Tensor], page_layouts: dict[str, KVPageLayout], num_blocks: int,
              engine_signature: dict[str, Any]) -> "KVPageRegions":
        """`kv_caches`: each layer's allocated primary view of `num_blocks` pages; `page_layouts`: its layout;
        `engine_signature["kv_heads"]` (optional): per layer, the [first head, heads, total heads] of the KV heads
        its page holds (dense K/V split over TP ranks; absent or None where every rank holds the whole cache)."""
        names = list(kv_caches)
        buffers = [_layer_buffer(kv_caches[name], page_layouts[name], num_blocks) for name in names]
        regions = [_layer_regions(buffer, page_layouts[name]) for name, buffer in zip(names, buffers)]
        signature = dict(engine_signature)
        kv_heads = signature.pop("kv_heads", None) or {}
        signature["layers"] = [[name, [int(region.shape[1]) for region in layer_regions],
                                component_descriptions(page_layouts[name]), kv_heads.get(name)]
                               for name, layer_regions in zip(names, regions)]
        return KVPageRegions(names, regions, signature, [page_layouts[name] for name in names], buffers)

    @property
    def num_blocks(self) -> int:
        return int(self.regions[0][0].shape[0]) if self.regions else 0

    def flat_regions(self, layer_indices: list[int] | None = None) -> list[torch.Tensor]:
        """The regions of `layer_indices` (None: every layer), layer by layer: gather()'s order."""
        indices = range(len(self.regions)) if layer_indices is None else layer_indices
        return [region for index in indices for region in self.regions[index]]

    def gather(self, block_ids: list[int], layer_indices: list[int] | None = None) -> list[torch.Tensor]:
        """The blocks' bytes, one contiguous [len(block_ids), region bytes] tensor per region (of `layer_indices`,
        None: every layer): a view of the cache when the ids are consecutive (nothing copied; the caller keeps
        the blocks unchanged while it reads), else a copy."""
        runs = _consecutive_runs(block_ids)
        flat = self.flat_regions(layer_indices)
        if len(runs) == 1:
            _, first_block, length = runs[0]
            return [region[first_block:first_block + length] for region in flat]
        return [torch.cat([region[first_block:first_block + length] for _, first_block, length in runs])
                for region in flat]

    def region_bytes(self) -> list[int]:
        """Bytes one block has in each region, in gather() order."""
        return [int(region.shape[1]) for layer_regions in self.regions for region in layer_regions]

    def scatter(self, block_ids: list[int], sources: list[torch.Tensor],
                layer_indices: list[int] | None = None) -> None:
        """Write `sources` (gather()'s form, for `layer_indices`) into the blocks `block_ids`."""
        # Runs of consecutive block ids are copied as slices: index_copy_ on byte rows is ~50x slower than memcpy.
        runs = _consecutive_runs(block_ids)
        for region, source in zip(self.flat_regions(layer_indices), sources, strict=True):
            for first_row, first_block, length in runs:
                region[first_block:first_block + length].copy_(source[first_row:first_row + length])

    def copy_heads(self, layer_index: int, block_ids: list[int], remote_layout: KVPageLayout,
                   remote_regions: list[torch.Tensor], remote_head_start: int, local_head_start: int,
                   num_heads: int) -> None:
        """Write heads [remote_head_start, +num_heads) of a producer's pages of layer `layer_index` (its regions
        [len(block_ids), region bytes] in `remote_layout`, which differs from the local one only in the number of
        KV heads) into local heads [local_head_start, +num_heads) of the blocks `block_ids`, every component."""
        layout = self.layouts[layer_index]
        if remote_layout.is_interleaved:
            remote_buffer = remote_regions[0]
        else:  # planar: the regions, one after another, are the planar buffer of len(block_ids) pages
            remote_buffer = torch.cat([region.reshape(-1) for region in remote_regions])
        remote_buffer = remote_buffer.reshape(len(block_ids), remote_layout.page_bytes)
        local_views = layout.views(self.buffers[layer_index])
        for component in layout.components:
            # [*leading, blocks, block_size, heads, ...]: the block axis after the planes, the heads two later.
            block_axis = len(component.leading_shape)
            source = remote_layout.view(remote_buffer, component.name).narrow(block_axis + 2, remote_head_start,
                                                                              num_heads)
            target = local_views[component.name].narrow(block_axis + 2, local_head_start, num_heads)
            for first_row, first_block, length in _consecutive_runs(block_ids):
                target.narrow(block_axis, first_block, length).copy_(source.narrow(block_axis, first_row, length))


def component_descriptions(layout: KVPageLayout) -> list[str]:
    """A layout's components as the handshake compares them: name, dtype, planes and per-token shape."""
    return [f"{c.name}:{c.dtype}:{list(c.leading_shape)}:{list(c.per_token_shape)}" for c in layout.components]


def with_num_heads(layout: KVPageLayout, num_heads: int) -> KVPageLayout:
    """`layout` (a dense K/V page: every component's first per-token axis is the KV head) for `num_heads` heads."""
    return KVPageLayout.pack(layout.block_size, [
        replace(component, per_token_shape=(num_heads, *component.per_token_shape[1:]))
        for component in layout.components], is_interleaved=layout.is_interleaved)


def _consecutive_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first row, first block id, length) of each run of consecutive ids in `block_ids`."""
    runs: list[tuple[int, int, int]] = []
    for row, block_id in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((row, block_id, 1))
    return runs


def _layer_buffer(kv_cache: torch.Tensor, layout: KVPageLayout, num_blocks: int) -> torch.Tensor:
    """The layer's page buffer (uint8 [num_blocks, page_bytes]), found from its primary view."""
    # The primary view is the first component, which sits at byte 0 of the page (and of the planar buffer).
    if layout.offsets[0] != 0:
        raise ValueError(f"KV page layout puts its first component at byte {layout.offsets[0]}; the transfer "
                         f"expects byte 0")
    element_size = kv_cache.element_size()
    start = kv_cache.storage_offset() * element_size
    flat = torch.empty(0, dtype=torch.uint8, device=kv_cache.device).set_(
        kv_cache.untyped_storage(), start, (num_blocks * layout.page_bytes,))
    return flat.view(num_blocks, layout.page_bytes)


def _layer_regions(buffer: torch.Tensor, layout: KVPageLayout) -> list[torch.Tensor]:
    """The layer's page buffer cut into its regions."""
    num_blocks = buffer.shape[0]
    if layout.is_interleaved:
        return [buffer]
    flat = buffer.view(-1)
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
