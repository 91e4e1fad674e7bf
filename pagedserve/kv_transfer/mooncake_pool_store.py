"""The KV pool on Mooncake Store (PyPI `mooncake-transfer-engine-non-cuda` on a CPU host; needs Debian
`libibverbs1`): a `mooncake_master` keeps the index, the clients (the engines' workers) lend the memory that holds
the blocks, and values move over TCP. A block lives in the memory of the client that stored it: when that engine
stops, its blocks leave the pool.
"""
from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

from pagedserve.kv_transfer.pool_store import KVPoolStore, KVPoolStoreError

# Transfer buffer of each client: the client stages a batch's values there, so batches are cut into pieces of an
# eighth of it (a worker's reads and writes run at once, and the buffer fragments: a 32 MiB read next to a write
# failed to allocate in a 64 MiB buffer; a value that cannot be staged reads as missing and is recomputed).
LOCAL_BUFFER_BYTES = 64 * 2**20
BATCH_BYTES = LOCAL_BUFFER_BYTES // 8


class MooncakePoolStore(KVPoolStore):
    def __init__(self, url: str, segment_bytes: int) -> None:
        """`url`: mooncake://host:port of the master; `segment_bytes`: memory this client lends (0: none)."""
        try:
            from mooncake.store import MooncakeDistributedStore
        except (ImportError, OSError) as error:
            raise KVPoolStoreError(f"the mooncake backend needs the PyPI package mooncake-transfer-engine-non-cuda "
                                   f"and Debian's libibverbs1: {error}") from error
        address = urlsplit(url)
        if not address.hostname or not address.port:
            raise KVPoolStoreError(f"mooncake url {url!r} must be mooncake://host:port")
        self.store = MooncakeDistributedStore()
        # P2PHANDSHAKE: peers exchange their transfer metadata directly (no etcd or metadata server).
        status = self.store.setup(address.hostname, "P2PHANDSHAKE", segment_bytes, LOCAL_BUFFER_BYTES, "tcp", "",
                                  f"{address.hostname}:{address.port}")
        if status != 0:
            raise KVPoolStoreError(f"mooncake: no master at {address.hostname}:{address.port} (setup returned "
                                   f"{status})")
        # The largest value seen so far: gets are batched by it (a store holds one engine's blocks, one size).
        self._value_bytes = 0

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        found = self.store.batch_is_exist(list(keys))
        if any(value < 0 for value in found):
            raise KVPoolStoreError(f"mooncake: existence lookup failed ({min(found)})")
        return [value == 1 for value in found]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        values: list[bytes | None] = []
        start = 0
        while start < len(keys):
            # Before the first value is seen its size is unknown: one key first.
            count = max(1, BATCH_BYTES // self._value_bytes) if self._value_bytes else 1
            # get_batch answers b"" both for a missing key and an unreachable master: the caller sees a miss.
            for value in self.store.get_batch(list(keys[start:start + count])):
                self._value_bytes = max(self._value_bytes, len(value))
                values.append(value or None)
            start += count
        return values

    def put(self, items: Sequence[tuple[str, bytes]]) -> None:
        if not items:
            return
        batch: list[tuple[str, bytes]] = []
        batch_bytes = 0
        for item in items:
            self._value_bytes = max(self._value_bytes, len(item[1]))
            if batch and batch_bytes + len(item[1]) > BATCH_BYTES:
                self._put_batch(batch)
                batch, batch_bytes = [], 0
            batch.append(item)
            batch_bytes += len(item[1])
        self._put_batch(batch)

    def _put_batch(self, items: list[tuple[str, bytes]]) -> None:
        status = self.store.put_batch([key for key, _ in items], [value for _, value in items])
        if status != 0:
            raise KVPoolStoreError(f"mooncake: put of {len(items)} blocks failed ({status})")

    def remove(self, key: str) -> None:
        # force: a block read a moment ago is under a read lease (10 s by default) that would refuse the removal.
        self.store.remove(key, True)

    def close(self) -> None:
        self.store.close()
