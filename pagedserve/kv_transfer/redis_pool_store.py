"""The KV pool on Redis or Valkey (PyPI `redis`; Debian's `redis-server`): one string value per block."""
from __future__ import annotations

from collections.abc import Sequence

from pagedserve.kv_transfer.pool_store import KVPoolStore, KVPoolStoreError


class RedisPoolStore(KVPoolStore):
    def __init__(self, url: str, timeout_s: float) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as error:
            raise KVPoolStoreError("the redis backend needs the PyPI package 'redis' (pip install "
                                   "'pagedserve[pool]')") from error
        self._errors = (redis.RedisError, OSError)
        # No retries: a down store must cost one timeout, not a backoff series, on the engine's thread.
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry=Retry(NoBackoff(), 0))
        self._call(self.client.ping)

    def _call(self, operation, *args):  # type: ignore[no-untyped-def]
        try:
            return operation(*args)
        except self._errors as error:
            raise KVPoolStoreError(f"redis: {error}") from error

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        pipeline = self.client.pipeline(transaction=False)
        for key in keys:
            pipeline.exists(key)
        return [bool(found) for found in self._call(pipeline.execute)]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        return list(self._call(self.client.mget, list(keys)))

    def put(self, items: Sequence[tuple[str, bytes]]) -> None:
        if not items:
            return
        self._call(self.client.mset, dict(items))

    def remove(self, key: str) -> None:
        self._call(self.client.delete, key)

    def close(self) -> None:
        self.client.close()
