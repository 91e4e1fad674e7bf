"""The KV pool's store seam: a shared key-value store of KV blocks, one implementation per backend.

A store only moves opaque values (pool_block_format.py names and checks them). Every operation either succeeds or
raises KVPoolStoreError, within the backend's timeouts, so that callers can go on without the pool.
Backends: redis_pool_store.py (Redis / Valkey), mooncake_pool_store.py (Mooncake Store), local_pool_store.py (this
host's memory, then a disk folder: a tier for the blocks the device cache evicts).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from pagedserve.config.kv_pool import KVPoolConfig


class KVPoolStoreError(RuntimeError):
    """The store is unreachable, or refused an operation."""


class KVPoolStore(ABC):
    """One client connection to the shared store (thread-safe: a worker reads and writes from two threads)."""

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored, in one round trip."""

    @abstractmethod
    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's value (None: not stored), in one round trip where the backend allows it."""

    @abstractmethod
    def put(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Store every (key, value); a key already stored may keep its value (values are content-addressed)."""

    @abstractmethod
    def remove(self, key: str) -> None:
        """Drop a key (a value found corrupted), so that the next put of it stores a good one."""

    def close(self) -> None:
        return None


def connect_pool_store(config: KVPoolConfig, timeout_s: float, lends_memory: bool) -> KVPoolStore:
    """A connected client of `config`'s store; `timeout_s` bounds each operation where the backend allows it;
    `lends_memory`: a Mooncake client that also holds blocks for the store (a worker; the scheduler's lookups
    need none). May block while the store is down (Mooncake retries its master for about 90 s): call it off the
    engine's thread."""
    if config.backend == "local":
        from pagedserve.kv_transfer.local_pool_store import LocalPoolStore

        return LocalPoolStore(config.store_url, config.local_memory_bytes, config.local_disk_bytes)
    if config.backend == "redis":
        from pagedserve.kv_transfer.redis_pool_store import RedisPoolStore

        return RedisPoolStore(config.store_url, timeout_s)
    from pagedserve.kv_transfer.mooncake_pool_store import MooncakePoolStore

    return MooncakePoolStore(config.store_url, config.mooncake_segment_bytes if lends_memory else 0)
