"""OffloadTier: the second KV tier, one memory-mapped file holding every offloaded layer's latent rows.

The file is created sparse (ftruncate: unwritten pages read as zeros and take no disk space) and mapped shared, so
the operating system pages rows in and out: the tier may exceed RAM. Each layer sees its part as an ordinary tensor
[num_blocks, block_size, width] indexed by the engine's block ids, so prefix caching, preemption and freeing treat
the tier exactly as they treat the resident cache.

The file is removed by `close` (engine shutdown) or, failing that, when the tier is garbage-collected or the
interpreter exits.
"""
from __future__ import annotations

import logging
import math
import os
import tempfile
import weakref

import torch

logger = logging.getLogger(__name__)

TIER_FILE_PREFIX = "pagedserve-kv-tier-"


def _remove_file(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class OffloadTier:
    def __init__(self, layer_shapes: list[tuple[int, ...]], dtype: torch.dtype, directory: str | None) -> None:
        """One region per shape in `layer_shapes`, in order, in a new file under `directory` (None: the system's
        temporary directory)."""
        element_size = torch.empty((), dtype=dtype).element_size()
        sizes = [math.prod(shape) for shape in layer_shapes]
        total_elements = sum(sizes)
        directory = os.path.expanduser(directory) if directory is not None else tempfile.gettempdir()
        descriptor, self.path = tempfile.mkstemp(prefix=TIER_FILE_PREFIX, suffix=".bin", dir=directory)
        self._finalizer = weakref.finalize(self, _remove_file, self.path)
        try:
            os.ftruncate(descriptor, max(total_elements, 1) * element_size)
        finally:
            os.close(descriptor)
        try:
            storage = torch.from_file(self.path, shared=True, size=max(total_elements, 1), dtype=dtype)
        except Exception:
            self.close()
            raise
        self.num_bytes = total_elements * element_size
        self.layer_views: list[torch.Tensor] = []
        offset = 0
        for shape, size in zip(layer_shapes, sizes):
            self.layer_views.append(storage[offset:offset + size].view(shape))
            offset += size
        logger.info("sparse KV offload tier: %s (%.1f MiB, memory-mapped)", self.path, self.num_bytes / 2**20)

    @property
    def is_open(self) -> bool:
        return self._finalizer.alive

    def close(self) -> None:
        """Remove the file (idempotent). The mapping lives on while tensors still view it; the tier is unusable
        for new engines either way."""
        self._finalizer()


__all__ = ["OffloadTier", "TIER_FILE_PREFIX"]
