"""The scheduler with the PoolConnector's scheduler side over an in-memory store and fabricated worker reports: a
pool hit after the local prefix hit loads only the blocks past it, the request then computes only the rest, the
external prefix cache counters count it, completed blocks are ordered stored once, and blocks that did not arrive
are recomputed and stored again."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedserve.config.kv_transfer import KVTransferConfig
from pagedserve.config.scheduler import SchedulerConfig
from pagedserve.core.block_hash import update_request_block_hashes
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.scheduler_output import KVConnectorOutput
from pagedserve.kv_transfer.pool_block_format import block_key
from pagedserve.kv_transfer.pool_connector_scheduler import PoolConnectorScheduler
from pagedserve.kv_transfer.pool_store import KVPoolStore

BLOCK_SIZE = 4
SIGNATURE = {"block_size": BLOCK_SIZE, "dtype": "torch.float32", "model_name": "tiny"}


class MemoryStore(KVPoolStore):
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [key in self.values for key in keys]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.values.get(key) for key in keys]

    def put(self, items: Sequence[tuple[str, bytes]]) -> None:
        self.values.update(items)

    def remove(self, key: str) -> None:
        self.values.pop(key, None)


class DirectConnection:
    """PoolStoreConnection's interface without a thread or a server."""

    def __init__(self, store: KVPoolStore) -> None:
        self.store = store

    def call(self, operation: Callable[[KVPoolStore], Any]) -> Any:
        return operation(self.store)

    def close(self) -> None:
        return None


def pool_scheduler(store: MemoryStore, policy: str = "recompute") -> tuple[Scheduler, PoolConnectorScheduler]:
    config = KVTransferConfig(kv_connector="PoolConnector", kv_role="kv_both", engine_id="e0",
                              kv_connector_extra_config={"backend": "redis"})
    connector = PoolConnectorScheduler(config, BLOCK_SIZE, SIGNATURE, connection=DirectConnection(store))
    scheduler = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64),
                          KVCacheManager(32, BLOCK_SIZE, True), BLOCK_SIZE, kv_connector=connector,
                          kv_load_failure_policy=policy)
    return scheduler, connector


def run(scheduler: Scheduler, model_output, connector_output: KVConnectorOutput | None = None):  # type: ignore[no-untyped-def]
    scheduler_output = scheduler.schedule()
    output = model_output(scheduler, scheduler_output)
    output.kv_connector_output = connector_output
    return scheduler_output, scheduler.update_from_output(scheduler_output, output)


def store_blocks(store: MemoryStore, connector: PoolConnectorScheduler, request: Any, indices: range) -> list[int]:
    hashes = update_request_block_hashes(request, BLOCK_SIZE)
    for index in indices:
        store.values[block_key(connector.fingerprint, hashes[index])] = b"stored"
    return hashes


def test_pool_hit_after_the_local_hit_loads_only_the_blocks_past_it(make_request, model_output) -> None:
    store = MemoryStore()
    scheduler, connector = pool_scheduler(store)
    prompt = list(range(100, 122))  # 22 tokens: 5 full blocks, the lookup may cover all 5 (never the last token)
    scheduler.add_request(make_request("local", prompt[:9], max_tokens=1))
    first, _ = run(scheduler, model_output)  # blocks 0 and 1 computed here: a local hit later, stored now
    hashes = update_request_block_hashes(make_request("probe", prompt), BLOCK_SIZE)
    assert first.kv_connector_metadata.puts == [(hashes[0], 1), (hashes[1], 2)]
    run(scheduler, model_output)
    request = make_request("d", prompt, max_tokens=2)
    store_blocks(store, connector, request, range(0, 4))  # the pool holds blocks 0-3 (another engine's)

    scheduler.add_request(request)
    parked, _ = run(scheduler, model_output)
    assert parked.num_scheduled_tokens == {} and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (order,) = parked.kv_connector_metadata.loads
    block_ids = scheduler.kv_cache_manager.get_block_ids("d")
    assert (order.first_block_index, order.block_hashes, order.local_block_ids) == (2, hashes[2:4], block_ids[2:4])
    stats = scheduler.make_stats()
    assert (stats.external_prefix_cache_queries, stats.external_prefix_cache_hits) == (9 + 22, 8)
    assert stats.prefix_cache_hits == 8  # the local hit (blocks 0, 1) comes first

    run(scheduler, model_output, KVConnectorOutput(finished_recving={"d"}))
    resumed, _ = run(scheduler, model_output)
    assert resumed.num_scheduled_tokens == {"d": 6}  # 16 tokens loaded (8 local, 8 pool): the rest is computed
    # Only block 4 is new to both caches: it is the one stored.
    assert resumed.kv_connector_metadata.puts == [(hashes[4], scheduler.kv_cache_manager.get_block_ids("d")[4])]


def test_blocks_that_did_not_arrive_are_recomputed_and_stored_again(make_request, model_output) -> None:
    """Even with kv_load_failure_policy='fail' (meant for a PD producer that vanished): a pool miss is no error."""
    store = MemoryStore()
    scheduler, connector = pool_scheduler(store, policy="fail")
    prompt = list(range(300, 318))  # 18 tokens: 4 full blocks
    request = make_request("d", prompt, max_tokens=1)
    hashes = store_blocks(store, connector, request, range(0, 4))
    scheduler.add_request(request)
    parked, _ = run(scheduler, model_output)
    (order,) = parked.kv_connector_metadata.loads
    assert order.block_hashes == hashes[:4]
    # Block 1 came back corrupted: blocks 1 on are recomputed.
    run(scheduler, model_output, KVConnectorOutput(finished_recving={"d"},
                                                   invalid_block_ids=set(order.local_block_ids[1:])))
    resumed, _ = run(scheduler, model_output)
    assert resumed.num_scheduled_tokens == {"d": 14}
    assert [block_hash for block_hash, _ in resumed.kv_connector_metadata.puts] == hashes[1:4]


def test_a_pool_that_is_down_is_a_miss(make_request, model_output) -> None:
    class DownConnection(DirectConnection):
        def call(self, operation: Callable[[KVPoolStore], Any]) -> Any:
            return None

    config = KVTransferConfig(kv_connector="PoolConnector", kv_role="kv_both",
                              kv_connector_extra_config={"backend": "redis"})
    connector = PoolConnectorScheduler(config, BLOCK_SIZE, SIGNATURE, connection=DownConnection(MemoryStore()))
    scheduler = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64),
                          KVCacheManager(32, BLOCK_SIZE, True), BLOCK_SIZE, kv_connector=connector)
    scheduler.add_request(make_request("d", list(range(10, 30)), max_tokens=1))
    output, _ = run(scheduler, model_output)
    assert output.num_scheduled_tokens == {"d": 20}
    stats = scheduler.make_stats()
    assert (stats.external_prefix_cache_queries, stats.external_prefix_cache_hits) == (20, 0)
