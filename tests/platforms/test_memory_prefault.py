"""The background KV cache prefault: pages become resident, contents never change, stop() ends it, the engine starts
and stops it, and bad inputs are refused."""
from __future__ import annotations

import errno

import pytest
import torch

from pagedserve.platforms.huge_page_memory import allocate_huge_page_zeros
from pagedserve.platforms.memory_prefault import (PAGE_BYTES, BackgroundPrefault, populate_for_write,
                                                  whole_pages)

MIB = 1 << 20


def _is_supported() -> bool:
    probe = allocate_huge_page_zeros((2 * MIB,), torch.uint8)
    return populate_for_write(*whole_pages(probe)) == 0


requires_populate = pytest.mark.skipif(not _is_supported(),
                                       reason="this kernel has no madvise(MADV_POPULATE_WRITE) (Linux < 5.14)")


def _resident_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@requires_populate
def test_pages_become_resident_and_contents_are_kept() -> None:
    tensor = allocate_huge_page_zeros((96 * MIB,), torch.uint8)
    tensor[5 * MIB:5 * MIB + 3] = torch.tensor([7, 8, 9], dtype=torch.uint8)  # written before: must survive
    before = _resident_bytes()
    prefault = BackgroundPrefault([tensor], chunk_bytes=8 * MIB)
    prefault.join(timeout=60)
    assert not prefault.is_alive() and prefault.error == 0
    assert prefault.num_populated_bytes == prefault.num_total_bytes == 96 * MIB
    assert _resident_bytes() - before >= 80 * MIB  # the lazily mapped pages are now resident
    assert tensor[5 * MIB:5 * MIB + 3].tolist() == [7, 8, 9]
    assert int(tensor.count_nonzero()) == 3


@requires_populate
def test_stop_ends_it_between_chunks() -> None:
    tensors = [allocate_huge_page_zeros((64 * MIB,), torch.uint8) for _ in range(4)]
    prefault = BackgroundPrefault(tensors, chunk_bytes=PAGE_BYTES)  # ~65k calls: far from done when stopped
    prefault.stop(timeout=30)
    assert not prefault.is_alive()
    assert prefault.num_populated_bytes < prefault.num_total_bytes and prefault.error is None


def test_whole_pages_never_leave_the_tensor() -> None:
    buffer = torch.zeros(3 * PAGE_BYTES, dtype=torch.uint8)
    inner = buffer[100:100 + 2 * PAGE_BYTES]
    address, length = whole_pages(inner)
    assert address % PAGE_BYTES == 0 and address >= inner.data_ptr()
    assert address + length <= inner.data_ptr() + inner.numel()
    assert whole_pages(buffer[:10]) == (whole_pages(buffer[:10])[0], 0)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="chunk_bytes=100 must be a positive multiple of the page size"):
        BackgroundPrefault([torch.zeros(4)], chunk_bytes=100)
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        BackgroundPrefault([torch.zeros(4, 4).t()])


def test_unmapped_range_reports_the_error() -> None:
    assert populate_for_write(PAGE_BYTES, PAGE_BYTES) in (errno.ENOMEM, errno.EINVAL, errno.EFAULT)


@requires_populate
def test_engine_prefaults_its_kv_cache_and_stops_at_shutdown(tiny_model_dir) -> None:
    from pagedserve import LLM, SamplingParams

    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=128, num_kv_blocks=64)
    executor = llm.llm_engine.engine_core.executor
    worker = executor.worker
    prefault = worker.kv_cache_prefault
    assert isinstance(prefault, BackgroundPrefault)
    output = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, temperature=0.0),
                          use_tqdm=False)  # steps run while (or after) the pages are populated
    assert len(output[0].outputs[0].token_ids) == 4
    prefault.join(timeout=60)
    assert prefault.error == 0 and prefault.num_populated_bytes == prefault.num_total_bytes > 0
    executor.shutdown()
    assert worker.kv_cache_prefault is None and not prefault.is_alive()
