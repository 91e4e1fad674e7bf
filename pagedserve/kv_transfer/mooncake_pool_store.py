"""The KV pool on Mooncake Store (PyPI `mooncake-transfer-engine-non-cuda` on a CPU host; needs Debian
`libibverbs1`): a `mooncake_master` keeps the index, the clients (the engines' workers) lend the memory that holds
the blocks, and values move over TCP. A block lives in the memory of the client that stored it: when that engine
stops, its blocks leave the pool.
"""
from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

from pagedserve.kv_transfer.pool_store import KVPoolStore, KVPoolStoreError

# Transfer buffer of each client (Mooncake's default); values larger than it are moved in pieces.
LOCAL_BUFFER_BYTES = 16 * 2**20


class MooncakePoolStore(KVPoolStore):
    def __init__(self, url: str, segment_bytes: int) -> None:
        """`url`: mooncake://host:port of the master; `segment_bytes`: memory this client lends (0: none)."""
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as error:
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
        # get_batch answers b"" both for a missing key and an unreachable master: the caller sees a miss.
        return [value or None for value in self.store.get_batch(list(keys))]

    def put(self, items: Sequence[tuple[str, bytes]]) -> None:
        if not items:
            return
        status = self.store.put_batch([key for key, _ in items], [value for _, value in items])
        if status != 0:
            raise KVPoolStoreError(f"mooncake: put of {len(items)} blocks failed ({status})")

    def remove(self, key: str) -> None:
        # force: a block read a moment ago is under a read lease (10 s by default) that would refuse the removal.
        self.store.remove(key, True)

    def close(self) -> None:
        self.store.close()
