"""The KV pool as a local tier: host memory, then a disk folder, for the blocks of the engines of one process (and,
through the folder, of one host). With `"backend": "local"` an engine keeps every full block it computes past its
device cache, so that a prefix the device cache evicted is loaded back instead of recomputed.

Memory holds the most recently used values up to `local_memory_bytes`; the least recently used move to the folder
(url local:///path; local:// has none, and they are dropped), which holds up to `local_disk_bytes`, its least
recently used files deleted first. The tier is one object per process and url: the scheduler's lookups and the
worker's reads and writes see the same blocks. Files already in the folder at start are served (a restarted engine
finds its blocks; the value checks of pool_block_format.py still apply).
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from urllib.parse import urlsplit

from pagedserve.kv_transfer.pool_store import KVPoolStore, KVPoolStoreError

# File name of a key: keys hold '/', which a file name may not.
_SEPARATOR = "~"


class LocalTier:
    """The memory and disk levels; thread-safe."""

    def __init__(self, folder: str | None, memory_bytes: int, disk_bytes: int) -> None:
        self.folder = folder
        self.memory_bytes = memory_bytes
        self.disk_bytes = disk_bytes if folder else 0
        self._lock = threading.Lock()
        self._memory: OrderedDict[str, bytes] = OrderedDict()
        self._memory_used = 0
        # key -> file size, least recently used first.
        self._disk: OrderedDict[str, int] = OrderedDict()
        self._disk_used = 0
        if folder:
            os.makedirs(folder, exist_ok=True)
            entries = sorted(os.scandir(folder), key=lambda entry: entry.stat().st_mtime)
            for entry in entries:
                if entry.is_file() and not entry.name.endswith(".tmp"):
                    self._disk[entry.name.replace(_SEPARATOR, "/")] = entry.stat().st_size
                    self._disk_used += entry.stat().st_size

    def _path(self, key: str) -> str:
        assert self.folder is not None
        return os.path.join(self.folder, key.replace("/", _SEPARATOR))

    def exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key in self._memory or key in self._disk for key in keys]

    def get(self, key: str) -> bytes | None:
        with self._lock:
            value = self._memory.get(key)
            if value is not None:
                self._memory.move_to_end(key)
                return value
            if key not in self._disk:
                return None
            self._disk.move_to_end(key)
        try:
            with open(self._path(key), "rb") as file:
                return file.read()
        except OSError:  # deleted meanwhile (evicted, or by hand): a miss
            return None

    def put(self, key: str, value: bytes) -> None:
        spilled: list[tuple[str, bytes]] = []
        with self._lock:
            if key in self._memory:
                self._memory_used -= len(self._memory.pop(key))
            self._memory[key] = value
            self._memory_used += len(value)
            while self._memory_used > self.memory_bytes and self._memory:
                old_key, old_value = self._memory.popitem(last=False)
                self._memory_used -= len(old_value)
                if self.disk_bytes and old_key not in self._disk:
                    spilled.append((old_key, old_value))
        for old_key, old_value in spilled:  # file writes outside the lock
            self._write(old_key, old_value)

    def _write(self, key: str, value: bytes) -> None:
        path = self._path(key)
        try:
            # Written whole, then renamed: a reader never sees half a file.
            with open(path + ".tmp", "wb") as file:
                file.write(value)
            os.replace(path + ".tmp", path)
        except OSError as error:
            raise KVPoolStoreError(f"local tier: cannot write {path}: {error}") from error
        evicted: list[str] = []
        with self._lock:
            self._disk[key] = len(value)
            self._disk_used += len(value)
            while self._disk_used > self.disk_bytes and self._disk:
                old_key, size = self._disk.popitem(last=False)
                self._disk_used -= size
                evicted.append(old_key)
        for old_key in evicted:
            try:
                os.remove(self._path(old_key))
            except OSError:
                pass

    def remove(self, key: str) -> None:
        with self._lock:
            value = self._memory.pop(key, None)
            if value is not None:
                self._memory_used -= len(value)
            size = self._disk.pop(key, None)
            if size is not None:
                self._disk_used -= size
        if size is not None:
            try:
                os.remove(self._path(key))
            except OSError:
                pass


_tiers: dict[str, LocalTier] = {}
_tiers_lock = threading.Lock()


def local_tier(url: str, memory_bytes: int, disk_bytes: int) -> LocalTier:
    """The process's tier for `url` (made on first use)."""
    with _tiers_lock:
        tier = _tiers.get(url)
        if tier is None:
            folder = urlsplit(url).path or None
            tier = _tiers[url] = LocalTier(folder, memory_bytes, disk_bytes)
        return tier


class LocalPoolStore(KVPoolStore):
    def __init__(self, url: str, memory_bytes: int, disk_bytes: int) -> None:
        self.tier = local_tier(url, memory_bytes, disk_bytes)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self.tier.exists(keys)

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.tier.get(key) for key in keys]

    def put(self, items: Sequence[tuple[str, bytes]]) -> None:
        for key, value in items:
            self.tier.put(key, value)

    def remove(self, key: str) -> None:
        self.tier.remove(key)
