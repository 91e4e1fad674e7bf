"""Multi-component KV pages: what one block id holds in one layer's cache, as typed views over one byte buffer.

A layer's cache is a single uint8 buffer of `num_blocks * page_bytes` bytes. Its layout lists components; each
has a dtype, a leading shape of planes (K and V: (2,)) and a per-token shape, and sits at a byte offset of the
page (aligned to its element size). Each component is seen through a typed view (as_strided over the buffer's
storage, no copy):

    [*leading_shape, num_blocks, block_size, *per_token_shape]

so a write through one component's view changes only that component's bytes, and block b of every component
belongs to whoever holds block id b: the latent, the scales and the indexer keys of a token share its block id
(one block-id pool for every layer and every component; prefix caching, preemption and freeing move them as one).

Two arrangements of the same page bytes in the buffer:
- interleaved: block b's page is the bytes [b * page_bytes, (b + 1) * page_bytes): everything one block id owns
  in this layer is contiguous (int8 pages with their scales, the DSA latent with its indexer keys);
- planar: each plane of the page is its own region over all blocks. The page's byte range [s, e) of a plane
  lives at [num_blocks * s, num_blocks * e) of the buffer, block b's part at num_blocks * s + b * (e - s). A
  one-component cache is then an ordinary contiguous tensor (the float K/V cache [2, num_blocks, block_size,
  H_kv, D] that the native kernels and `.view` reshapes expect).
Bytes per block id are page_bytes either way, so sizing does not depend on the arrangement.

The allocator returns the layout's first component (the layer's `kv_cache`) with every component's view attached
(`kv_cache_component`), so a layer keeps one cache object and finds its other components from it.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Attribute of an allocated primary view holding {component name: view} of its buffer.
_COMPONENTS_ATTRIBUTE = "_pagedserve_kv_components"


@dataclass(frozen=True)
class KVCacheComponent:
    """One kind of per-token data a layer keeps in its page: `leading_shape` planes of `block_size` tokens x
    `per_token_shape` values of `dtype` each."""

    name: str
    dtype: torch.dtype
    per_token_shape: tuple[int, ...]
    leading_shape: tuple[int, ...] = ()

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def num_planes(self) -> int:
        return math.prod(self.leading_shape)

    def plane_bytes(self, block_size: int) -> int:
        """Bytes of one plane of one block."""
        return block_size * math.prod(self.per_token_shape) * self.element_size

    def page_bytes(self, block_size: int) -> int:
        """Bytes of this component in one page (all planes)."""
        return self.num_planes * self.plane_bytes(block_size)


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass(frozen=True)
class KVPageLayout:
    """Components at byte offsets of one page of `page_bytes` bytes (see the module docstring). Build it with
    `pack`; `views` gives the typed views of a buffer holding `num_blocks` pages."""

    block_size: int
    components: tuple[KVCacheComponent, ...]
    offsets: tuple[int, ...]
    page_bytes: int
    is_interleaved: bool = True

    @staticmethod
    def pack(block_size: int, components: tuple[KVCacheComponent, ...] | list[KVCacheComponent], *,
             is_interleaved: bool = True) -> KVPageLayout:
        """The components one after another, each at the next offset aligned to its element size; the page is
        padded to the largest element size, so that every page of an interleaved buffer keeps the alignment."""
        components = tuple(components)
        if not components:
            raise ValueError("a KV page needs at least one component")
        names = [component.name for component in components]
        if len(set(names)) != len(names):
            raise ValueError(f"KV page component names must be unique, got {names}")
        offsets = []
        end = 0
        for component in components:
            start = _align(end, component.element_size)
            offsets.append(start)
            end = start + component.page_bytes(block_size)
        page_bytes = _align(end, max(component.element_size for component in components))
        return KVPageLayout(block_size, components, tuple(offsets), page_bytes, is_interleaved)

    @property
    def alignment(self) -> int:
        """The largest element size: a buffer must start at a multiple of it in its storage."""
        return max(component.element_size for component in self.components)

    def component(self, name: str) -> KVCacheComponent:
        return self.components[self._index(name)]

    def offset(self, name: str) -> int:
        return self.offsets[self._index(name)]

    def _index(self, name: str) -> int:
        for index, component in enumerate(self.components):
            if component.name == name:
                return index
        raise KeyError(f"no KV page component {name!r}; components: {[c.name for c in self.components]}")

    def byte_ranges(self) -> list[tuple[int, int]]:
        """The page cut into consecutive [start, end) ranges: each plane of each component and each padding gap,
        in page order (the unit the planar arrangement stores contiguously)."""
        ranges = []
        cursor = 0
        for component, offset in zip(self.components, self.offsets):
            if offset > cursor:
                ranges.append((cursor, offset))
            plane = component.plane_bytes(self.block_size)
            ranges += [(offset + index * plane, offset + (index + 1) * plane) for index in range(component.num_planes)]
            cursor = offset + component.page_bytes(self.block_size)
        if self.page_bytes > cursor:
            ranges.append((cursor, self.page_bytes))
        return ranges

    def _check_buffer(self, buffer: torch.Tensor) -> int:
        """The buffer's number of pages (ValueError when it is no contiguous uint8 [num_blocks, page_bytes])."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 2 or buffer.shape[1] != self.page_bytes \
                or not buffer.is_contiguous():
            raise ValueError(f"a KV page buffer must be a contiguous uint8 [num_blocks, {self.page_bytes}] tensor, "
                             f"got {buffer.dtype} {tuple(buffer.shape)}")
        if buffer.storage_offset() % self.alignment:
            raise ValueError(f"the KV page buffer starts at byte {buffer.storage_offset()} of its storage; a "
                             f"multiple of {self.alignment} is needed")
        return buffer.shape[0]

    def view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        """Component `name` of `buffer` (uint8 [num_blocks, page_bytes]) as
        [*leading_shape, num_blocks, block_size, *per_token_shape] of its dtype (a view: writes land in the
        buffer)."""
        num_blocks = self._check_buffer(buffer)
        component, offset = self.component(name), self.offset(name)
        size = component.element_size
        plane_bytes = component.plane_bytes(self.block_size)
        if self.is_interleaved:
            base, plane_stride, block_stride = offset, plane_bytes, self.page_bytes
        else:
            base, plane_stride, block_stride = num_blocks * offset, num_blocks * plane_bytes, plane_bytes
        token_shape = (self.block_size, *component.per_token_shape)
        inner_strides = [1] * len(token_shape)
        for axis in range(len(token_shape) - 2, -1, -1):
            inner_strides[axis] = inner_strides[axis + 1] * token_shape[axis + 1]
        leading_strides = [plane_stride // size] * len(component.leading_shape)
        for axis in range(len(component.leading_shape) - 2, -1, -1):
            leading_strides[axis] = leading_strides[axis + 1] * component.leading_shape[axis + 1]
        shape = (*component.leading_shape, num_blocks, *token_shape)
        strides = (*leading_strides, block_stride // size, *inner_strides)
        # as_strided's storage offsets are absolute: the buffer may start inside its storage (the huge-page
        # allocator aligns it), so every view adds the buffer's own offset.
        typed = buffer.view(-1).view(component.dtype)
        return typed.as_strided(shape, strides, (buffer.storage_offset() + base) // size)

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every component's view of `buffer`, by name."""
        return {component.name: self.view(buffer, component.name) for component in self.components}

    def page(self, buffer: torch.Tensor, block_id: int) -> torch.Tensor:
        """Block `block_id`'s page bytes [page_bytes] in page order (a copy for the planar arrangement)."""
        num_blocks = self._check_buffer(buffer)
        if self.is_interleaved:
            return buffer[block_id]
        flat = buffer.view(-1)
        return torch.cat([flat[num_blocks * start + block_id * (end - start):][:end - start]
                          for start, end in self.byte_ranges()])

    def allocate(self, num_blocks: int,
                 allocate_zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> torch.Tensor:
        """Zeroed pages for `num_blocks` block ids (`allocate_zeros(shape, dtype)`: the platform's allocator);
        returns the first component's view with every component's view attached (kv_cache_component)."""
        buffer = allocate_zeros((num_blocks, self.page_bytes), torch.uint8)
        views = self.views(buffer)
        primary = views[self.components[0].name]
        setattr(primary, _COMPONENTS_ATTRIBUTE, views)
        return primary


def kv_cache_components(kv_cache: torch.Tensor) -> dict[str, torch.Tensor]:
    """{name: view} of the pages `kv_cache` (an allocated primary view) lives in; {} for a plain tensor."""
    return getattr(kv_cache, _COMPONENTS_ATTRIBUTE, {})


def kv_cache_component(kv_cache: torch.Tensor, name: str) -> torch.Tensor:
    """Component `name` of the pages `kv_cache` lives in (KeyError naming the components it has)."""
    components = kv_cache_components(kv_cache)
    if name not in components:
        raise KeyError(f"the KV cache (shape {tuple(kv_cache.shape)}) has no component {name!r}; it has "
                       f"{sorted(components)} (allocate it with KVPageLayout.allocate)")
    return components[name]


def attach_kv_cache_components(kv_cache: torch.Tensor, views: dict[str, torch.Tensor]) -> None:
    """Attach `views` to `kv_cache` (for caches rebuilt from their storage)."""
    setattr(kv_cache, _COMPONENTS_ATTRIBUTE, views)


__all__ = ["KVCacheComponent", "KVPageLayout", "attach_kv_cache_components", "kv_cache_component",
           "kv_cache_components"]
