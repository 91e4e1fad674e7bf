"""Faulting a tensor's pages in ahead of use, from a low-priority background thread (the CPU's KV cache).

The CPU KV cache is mapped lazily (huge_page_memory.py): a multi-GiB cache costs nothing at start, but the first
write of every page then faults it in, inside a request's step. On this VM that cost 0.25-0.6 ms per MiB (a
300-token prompt writes ~7 MiB of K/V over SmolLM2's 30 layers: ~4 ms of its prefill), and every request paid it
until the whole cache had been written once. vLLM's CPU worker zero-fills its cache at start instead, which
delays the start by the same amount.

Here a daemon thread asks the kernel to populate the pages, MADV_POPULATE_WRITE (Linux 5.14+), 64 MiB per call,
at nice 19: the engine is ready at once, the thread takes the CPU the engine leaves idle (ctypes releases the GIL
during the call), and steps stop faulting once it is done. The advice never changes memory contents (a page the
engine already wrote keeps its data), so it is safe while steps write K/V. Where the kernel lacks the advice the
thread stops at its first call and pages keep faulting in on first write, as before.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
DEFAULT_CHUNK_BYTES = 64 << 20
BACKGROUND_NICENESS = 19

_libc: ctypes.CDLL | None = None


def _madvise() -> ctypes._CFuncPtr:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def populate_for_write(address: int, length: int) -> int:
    """madvise(MADV_POPULATE_WRITE) over [address, address + length) (page-aligned): 0, or the errno."""
    if _madvise()(address, length, MADV_POPULATE_WRITE) == 0:
        return 0
    return ctypes.get_errno()


def whole_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """(address, length) of the whole pages inside the tensor's bytes (never beyond them)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // PAGE_BYTES) * PAGE_BYTES
    last = end // PAGE_BYTES * PAGE_BYTES
    return first, max(0, last - first)


class BackgroundPrefault:
    """Populates the pages of `tensors` (contiguous CPU tensors) in a low-priority daemon thread, started at once.

    `stop()` ends it early (between chunks) and waits for the thread; the engine calls it at shutdown. The thread
    holds the tensors only while it runs.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if chunk_bytes < PAGE_BYTES or chunk_bytes % PAGE_BYTES != 0:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive multiple of the page size {PAGE_BYTES}")
        for tensor in tensors:
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise ValueError(f"BackgroundPrefault takes contiguous CPU tensors, got device={tensor.device} "
                                 f"contiguous={tensor.is_contiguous()}")
        self.chunk_bytes = chunk_bytes
        self.num_total_bytes = sum(whole_pages(tensor)[1] for tensor in tensors)
        self.num_populated_bytes = 0
        # None while running or stopped early; 0 when every page was populated; else the errno that stopped it.
        self.error: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(list(tensors),), name="pagedserve-kv-prefault",
                                        daemon=True)
        self._thread.start()

    def _run(self, tensors: list[torch.Tensor]) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)  # this thread only
        except (AttributeError, OSError):  # not Linux, or not allowed: still correct, just not deprioritised
            pass
        for tensor in tensors:
            address, length = whole_pages(tensor)
            for offset in range(0, length, self.chunk_bytes):
                if self._stop.is_set():
                    return
                error = populate_for_write(address + offset, min(self.chunk_bytes, length - offset))
                if error != 0:
                    self.error = error
                    logger.debug("KV cache prefault stopped: madvise(MADV_POPULATE_WRITE) failed (%s); pages fault "
                                 "in on first write instead", os.strerror(error))
                    return
                self.num_populated_bytes += min(self.chunk_bytes, length - offset)
        self.error = 0

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stops after the chunk in progress and waits (at most `timeout` seconds) for the thread to end."""
        self._stop.set()
        self._thread.join(timeout)


__all__ = ["BackgroundPrefault", "MADV_POPULATE_WRITE", "populate_for_write", "whole_pages"]
