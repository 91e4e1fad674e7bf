"""Zero-filled host tensors backed by transparent huge pages (the CPU's KV cache).

The paged KV cache is written a block at a time at scattered addresses and read back the same way. On 4 KiB
pages every first write of a page is a page fault (measured: the K/V write of a 2048-token prefill chunk
spent ~1.3 ms per layer in faults, 4x its copy time) and every block read costs a TLB walk, which in a VM
walks two page tables. A 2 MiB-aligned anonymous mapping advised MADV_HUGEPAGE is faulted in 2 MiB at a time
and mapped by one TLB entry per 2 MiB: on this machine the decode attention of 64 requests ran ~20% faster
and the K/V write ~4x faster (batch-64 decode step 71-77 -> 63-67 ms).

Like calloc, the mapping costs nothing at start: pages are zero until first written, and memory is
committed as blocks are first touched (2 MiB at a time instead of 4 KiB). Where the kernel has no
transparent huge pages (or they are disabled) the advice is refused and the mapping simply stays on small
pages. The tensor owns the mapping: it is unmapped when the last view of the tensor is freed.
"""
from __future__ import annotations

import logging
import math
import mmap

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
THP_ENABLED_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"


def transparent_huge_page_mode(path: str = THP_ENABLED_PATH) -> str | None:
    """The kernel's THP setting ('always', 'madvise' or 'never'), None where the file is absent."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def allocate_huge_page_bytes(num_bytes: int) -> tuple[torch.Tensor, bool]:
    """A zero-filled uint8 CPU tensor of `num_bytes` (> 0) starting on a 2 MiB boundary of an anonymous mapping,
    and whether the kernel took the MADV_HUGEPAGE advice for it (see the module docstring)."""
    # Over-map by one huge page so the tensor can start on a 2 MiB boundary whatever address mmap returns.
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    is_advised = False
    madvise = getattr(mapping, "madvise", None)
    if madvise is not None and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            madvise(mmap.MADV_HUGEPAGE)
            is_advised = True
        except OSError as error:  # kernels without THP refuse the advice; small pages still work
            logger.debug("MADV_HUGEPAGE refused (%s): the mapping stays on small pages", error)
    # torch.frombuffer keeps `mapping` alive as long as any view of the tensor lives.
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % HUGE_PAGE_BYTES
    return raw[offset:offset + num_bytes], is_advised


def allocate_huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled, contiguous CPU tensor of `shape` whose storage starts on a 2 MiB boundary of an
    anonymous mapping advised MADV_HUGEPAGE (see the module docstring)."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return allocate_huge_page_bytes(num_bytes)[0].view(dtype).view(shape)


__all__ = ["HUGE_PAGE_BYTES", "allocate_huge_page_bytes", "allocate_huge_page_zeros", "transparent_huge_page_mode"]
