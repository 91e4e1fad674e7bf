"""The KV cache's host allocation: zero-filled, lazily committed, 2 MiB-aligned and on huge pages."""
from __future__ import annotations

import gc

import pytest
import torch

from pagedserve.platforms.cpu import CpuPlatform
from process_mappings import smaps_field_of_mapping
from pagedserve.platforms.huge_page_memory import (HUGE_PAGE_BYTES, allocate_huge_page_zeros,
                                                   transparent_huge_page_mode)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _anon_huge_bytes_of_mapping(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    return int(smaps_field_of_mapping(address, "AnonHugePages")[0]) * 1024


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_zero_filled_contiguous_and_aligned(dtype: torch.dtype) -> None:
    tensor = allocate_huge_page_zeros((2, 33, 16, 3, 64), dtype)
    assert tensor.shape == (2, 33, 16, 3, 64) and tensor.dtype == dtype and tensor.is_contiguous()
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not tensor.any()
    tensor[1, 32, 15, 2, 63] = 7
    assert tensor.sum().item() == 7


def test_platform_kv_allocation_uses_it() -> None:
    tensor = CpuPlatform().allocate_zeros((4, 16, 2, 8), torch.bfloat16)
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0 and not tensor.any()


def test_a_view_keeps_the_mapping_alive() -> None:
    view = allocate_huge_page_zeros((1024, 1024), torch.float32)[3:5]
    gc.collect()
    view.fill_(2.0)
    assert view.sum().item() == 2.0 * 2 * 1024


def test_memory_is_committed_only_when_written_and_released_when_freed() -> None:
    before = _resident_bytes()
    tensor = allocate_huge_page_zeros((1 << 30,), torch.uint8)  # 1 GiB
    assert _resident_bytes() - before < (64 << 20), "allocation must not touch the pages"
    tensor[: 256 << 20].fill_(1)
    assert _resident_bytes() - before > (200 << 20)
    del tensor
    gc.collect()
    assert _resident_bytes() - before < (64 << 20), "freeing the tensor must unmap it"


def test_empty_shape() -> None:
    tensor = allocate_huge_page_zeros((0, 16), torch.float32)
    assert tensor.shape == (0, 16)


def test_thp_mode_parsing(tmp_path) -> None:
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert transparent_huge_page_mode(str(path)) == "madvise"
    path.write_text("[always] madvise never\n")
    assert transparent_huge_page_mode(str(path)) == "always"
    assert transparent_huge_page_mode(str(tmp_path / "missing")) is None


@pytest.mark.skipif(transparent_huge_page_mode() not in ("always", "madvise"),
                    reason="this kernel offers no transparent huge pages to madvise")
def test_written_memory_lands_on_huge_pages() -> None:
    tensor = allocate_huge_page_zeros((64 << 20,), torch.uint8)
    tensor.fill_(1)
    # At least some of it: under memory fragmentation the kernel may fall back to small pages for a part.
    assert _anon_huge_bytes_of_mapping(tensor.data_ptr()) >= HUGE_PAGE_BYTES
