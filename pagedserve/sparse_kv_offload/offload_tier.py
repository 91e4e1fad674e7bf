"""OffloadTier: the second KV tier, one memory-mapped file holding every offloaded layer's latent rows.

The file is created sparse (ftruncate: unwritten pages read as zeros and take no disk space) and mapped shared, so
the operating system pages rows in and out: the tier may exceed RAM. Each layer sees its part as an ordinary tensor
[num_blocks, block_size, width] indexed by the engine's block ids, so prefix caching, preemption and freeing treat
the tier exactly as they treat the resident cache.

The file's name is unlinked as soon as it is mapped: the mapping keeps the data reachable, and the operating system
reclaims the space when the last mapping goes, even when the process is killed (SIGKILL leaves no file behind).
A tier on a RAM-backed file system (tmpfs, e.g. /dev/shm or a tmpfs /tmp) saves no memory: it is allowed, with a
warning naming the directory.
"""
from __future__ import annotations

import logging
import math
import os
import tempfile

import torch

logger = logging.getLogger(__name__)

TIER_FILE_PREFIX = "pagedserve-kv-tier-"


# File systems whose pages live in RAM (/proc/mounts names).
RAM_FILE_SYSTEMS = ("tmpfs", "ramfs")


def file_system_type(path: str) -> str | None:
    """The type of the file system holding `path` (the longest matching mount point in /proc/mounts); None where
    /proc/mounts cannot be read (not Linux)."""
    path = os.path.realpath(path)
    try:
        with open("/proc/mounts") as mounts:
            entries = [line.split() for line in mounts]
    except OSError:
        return None
    best_mount, best_type = "", None
    for entry in entries:
        if len(entry) < 3:
            continue
        mount_point = entry[1].replace("\\040", " ")
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best_mount):
            best_mount, best_type = mount_point, entry[2]
    return best_type


def free_disk_bytes(directory: str | None) -> int:
    """Bytes an unprivileged writer may still use under `directory` (None: the system's temporary directory)."""
    usage = os.statvfs(tier_directory(directory))
    return usage.f_bavail * usage.f_frsize


def tier_directory(directory: str | None) -> str:
    return os.path.expanduser(directory) if directory is not None else tempfile.gettempdir()


class OffloadTier:
    def __init__(self, layer_shapes: list[tuple[int, ...]], dtype: torch.dtype, directory: str | None) -> None:
        """One region per shape in `layer_shapes`, in order, in a new file under `directory` (None: the system's
        temporary directory)."""
        element_size = torch.empty((), dtype=dtype).element_size()
        sizes = [math.prod(shape) for shape in layer_shapes]
        total_elements = sum(sizes)
        directory = tier_directory(directory)
        file_system = file_system_type(directory)
        if file_system in RAM_FILE_SYSTEMS:
            logger.warning("sparse KV offload: tier_directory %s is on %s, which keeps files in RAM: the tier saves "
                           "no memory there; give sparse_kv_offload.tier_directory on a disk", directory, file_system)
        descriptor, self.path = tempfile.mkstemp(prefix=TIER_FILE_PREFIX, suffix=".bin", dir=directory)
        try:
            os.ftruncate(descriptor, max(total_elements, 1) * element_size)
            storage = torch.from_file(self.path, shared=True, size=max(total_elements, 1), dtype=dtype)
        finally:
            os.close(descriptor)
            # Mapped (or failed): the name is no longer needed; see the module docstring.
            os.unlink(self.path)
        self._is_open = True
        self.num_bytes = total_elements * element_size
        self.layer_views: list[torch.Tensor] = []
        offset = 0
        for shape, size in zip(layer_shapes, sizes):
            self.layer_views.append(storage[offset:offset + size].view(shape))
            offset += size
        logger.info("sparse KV offload tier: %.1f MiB memory-mapped from an unlinked file in %s",
                    self.num_bytes / 2**20, directory)

    @property
    def is_open(self) -> bool:
        return self._is_open

    def close(self) -> None:
        """Drop the tier's views (idempotent); the space is reclaimed once no tensor views the mapping."""
        self._is_open = False
        self.layer_views = []


__all__ = ["OffloadTier", "RAM_FILE_SYSTEMS", "TIER_FILE_PREFIX", "file_system_type", "free_disk_bytes",
           "tier_directory"]
