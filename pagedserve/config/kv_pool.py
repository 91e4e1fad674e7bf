"""KVPoolConfig: the KV pool's knobs, the kv_connector_extra_config of `"kv_connector": "PoolConnector"`.

    {"kv_connector": "PoolConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"backend": "mooncake", "url": "mooncake://127.0.0.1:50051"}}

Instances that name the same store share full KV blocks by their chained block hash (pagedserve/kv_transfer/
pool_connector_*.py). Why Mooncake Store is the default backend: docs/kv_pool.md.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

POOL_BACKENDS = ("redis", "mooncake", "local")
# Where each backend's server listens when no url is given (redis-server's and mooncake_master's own defaults).
DEFAULT_POOL_URLS = {"redis": "redis://127.0.0.1:6379/0", "mooncake": "mooncake://127.0.0.1:50051",
                     "local": "local://"}


@dataclass(frozen=True)
class KVPoolConfig:
    """How an engine reaches the shared KV block store and how long it may wait for it."""

    # Measured faster on a pool hit than redis (docs/kv_pool.md).
    backend: str = "mooncake"
    # redis://host:port/db (redis), mooncake://host:port (the mooncake_master's RPC address), or local:///folder
    # (local: the disk level's folder; local:// has none); None: the default.
    url: str | None = None
    # Seconds the scheduler's existence lookup may take before the pool counts as down (the engine waits on it).
    lookup_timeout_s: float = 0.5
    # Seconds a worker's block read or write may take before the pool counts as down.
    transfer_timeout_s: float = 5.0
    # Seconds after the pool was found down before it is tried again (meanwhile the engine runs without it).
    retry_interval_s: float = 30.0
    # Blocks waiting to be written to the pool; a step whose blocks do not fit skips their write (never waits).
    max_pending_puts: int = 256
    # Mooncake only: host memory each engine lends the store for blocks (the store keeps blocks in its clients).
    mooncake_segment_bytes: int = 512 * 2**20
    # Local tier only: host memory for blocks, then the disk folder's capacity (local_pool_store.py).
    local_memory_bytes: int = 1024 * 2**20
    local_disk_bytes: int = 16 * 2**30

    def __post_init__(self) -> None:
        place = "kv_transfer_config.kv_connector_extra_config"
        if self.backend not in POOL_BACKENDS:
            raise ValueError(f"{place}.backend={self.backend!r} must be one of {list(POOL_BACKENDS)}")
        if self.url is not None and (not isinstance(self.url, str) or "://" not in self.url):
            raise ValueError(f"{place}.url={self.url!r} must be a URL such as {DEFAULT_POOL_URLS[self.backend]!r}")
        if self.url is not None and not self.url.startswith(f"{self.backend}://"):
            raise ValueError(f"{place}.url={self.url!r} does not fit backend={self.backend!r}: it must start with "
                             f"'{self.backend}://'")
        for name in ("lookup_timeout_s", "transfer_timeout_s", "retry_interval_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{place}.{name}={value!r} must be a number > 0")
        for name in ("max_pending_puts", "mooncake_segment_bytes", "local_memory_bytes", "local_disk_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{place}.{name}={value!r} must be an integer >= 1")

    @property
    def store_url(self) -> str:
        """The url, or the backend's default."""
        return self.url or DEFAULT_POOL_URLS[self.backend]

    @staticmethod
    def from_extra_config(extra: dict[str, Any]) -> "KVPoolConfig":
        allowed = [item.name for item in fields(KVPoolConfig)]
        unknown = sorted(set(extra) - set(allowed))
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config has unknown keys {unknown} for "
                             f"PoolConnector; allowed: {allowed}")
        return KVPoolConfig(**extra)


__all__ = ["KVPoolConfig", "POOL_BACKENDS", "DEFAULT_POOL_URLS"]
