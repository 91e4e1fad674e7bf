"""PoolConnector, scheduler side: which blocks a request loads from the KV pool, and which blocks a step stores.

Load (consumer): after the local prefix-cache hit, the request's next full blocks are looked up by chained block
hash in one existence query; the leading run that the pool holds is loaded asynchronously (the request waits in
WAITING_FOR_REMOTE_KVS). The lookup never covers the last prompt token (its logits give the first token) and is
skipped for requests that want prompt logprobs (they need every position computed). A pool that is down or slow
(lookup_timeout_s) counts as a miss: the engine serves without it (pool_store_connection.py).
Store (producer): each step orders the worker to store the full blocks the step completed, past those the request
found in either cache; the worker copies them after the forward, so the blocks may be freed or reused at once.
Pure Python (it runs inside the scheduler).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.core.block_hash import update_request_block_hashes
from pagedserve.kv_transfer.connector_base import KVConnectorScheduler
from pagedserve.kv_transfer.pool_block_format import block_key, layout_fingerprint
from pagedserve.kv_transfer.pool_store_connection import PoolStoreConnection

if TYPE_CHECKING:
    from pagedserve.config.kv_transfer import KVTransferConfig
    from pagedserve.core.request import Request
    from pagedserve.core.scheduler_output import KVConnectorOutput, SchedulerOutput

# Seconds the scheduler waits for its first connection to the pool at start (a store that is down costs this once).
CONNECT_WAIT_S = 2.0


@dataclass
class PoolLoadOrder:
    """Load the pool's blocks `block_hashes` into `local_block_ids`, block `first_block_index` of the request on."""

    request_id: str
    first_block_index: int
    block_hashes: list[int]
    local_block_ids: list[int]


@dataclass
class PoolConnectorMetadata:
    """One step's orders for the worker side."""

    loads: list[PoolLoadOrder] = field(default_factory=list)
    # (chained block hash, block id) of the full blocks this step computes: stored after the forward.
    puts: list[tuple[int, int]] = field(default_factory=list)
    # Requests finished in the scheduler since the last step: a load still running for one is not written.
    finished_request_ids: list[str] = field(default_factory=list)


class PoolConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, block_size: int, engine_signature: dict[str, Any],
                 connection: PoolStoreConnection | None = None) -> None:
        """`engine_signature`: what makes this engine's blocks what they are (model, block size, dtypes)."""
        self.config = config
        self.pool_config = config.pool_config
        self.block_size = block_size
        self.fingerprint = layout_fingerprint(engine_signature)
        # Only a consumer looks blocks up (a producer-only engine just stores them).
        self.connection = connection
        if self.connection is None and config.is_consumer:
            self.connection = PoolStoreConnection(self.pool_config, self.pool_config.lookup_timeout_s,
                                                  lends_memory=False, owner="scheduler")
            self.connection.wait_connected(min(CONNECT_WAIT_S, self.pool_config.lookup_timeout_s * 4))
        self._loads: list[PoolLoadOrder] = []
        # Lookups answered and not yet allocated: request id -> (first block index, hashes the pool holds).
        self._matches: dict[str, tuple[int, list[int]]] = {}
        # Orders whose load has not been reported ended yet.
        self._loading: dict[str, PoolLoadOrder] = {}
        # Producer: the requests seen at admission, their block tables (from the steps' outputs) and the index of
        # the first block not yet stored or found stored.
        self._requests: dict[str, Request] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._next_put_block: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        request_id = request.request_id
        first_block = num_computed_tokens // self.block_size
        if self.config.is_producer:
            self._requests[request_id] = request
            self._next_put_block[request_id] = max(self._next_put_block.get(request_id, 0), first_block)
        if (not self.config.is_consumer or self.connection is None
                or request.sampling_params.prompt_logprobs is not None):
            return 0, False
        block_hashes = update_request_block_hashes(request, self.block_size)
        candidates = block_hashes[first_block:(request.num_tokens - 1) // self.block_size]
        if not candidates:
            return 0, False
        keys = [block_key(self.fingerprint, block_hash) for block_hash in candidates]
        found = self.connection.call(lambda store: store.exists(keys))
        if not found:
            return 0, False
        num_found = next((index for index, is_found in enumerate(found) if not is_found), len(found))
        if num_found == 0:
            return 0, False
        self._matches[request_id] = (first_block, candidates[:num_found])
        if self.config.is_producer:
            self._next_put_block[request_id] = max(self._next_put_block[request_id], first_block + num_found)
        return num_found * self.block_size, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        match = self._matches.pop(request.request_id, None)
        if num_external_tokens == 0 or match is None:
            return
        first_block, block_hashes = match
        order = PoolLoadOrder(request_id=request.request_id, first_block_index=first_block,
                              block_hashes=block_hashes,
                              local_block_ids=list(block_ids[first_block:first_block + len(block_hashes)]))
        self._loads.append(order)
        self._loading[request.request_id] = order

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PoolConnectorMetadata:
        puts: list[tuple[int, int]] = []
        if self.config.is_producer:
            for new_request in scheduler_output.scheduled_new_requests:
                self._block_ids[new_request.request_id] = list(new_request.block_ids)
            cached = scheduler_output.scheduled_cached_requests
            for request_id, new_block_ids in zip(cached.request_ids, cached.new_block_ids):
                self._block_ids.setdefault(request_id, []).extend(new_block_ids)
            for request_id in scheduler_output.num_scheduled_tokens:
                puts += self._blocks_to_put(request_id)
        metadata = PoolConnectorMetadata(loads=self._loads, puts=puts,
                                         finished_request_ids=sorted(scheduler_output.finished_request_ids))
        self._loads = []
        return metadata

    def _blocks_to_put(self, request_id: str) -> list[tuple[int, int]]:
        """The full blocks this step completes (the request's computed tokens already count this step's)."""
        request = self._requests.get(request_id)
        if request is None:
            return []
        block_hashes = update_request_block_hashes(request, self.block_size)
        block_ids = self._block_ids.get(request_id, [])
        num_full_blocks = min(request.num_computed_tokens // self.block_size, len(block_hashes), len(block_ids))
        first = self._next_put_block.get(request_id, 0)
        if num_full_blocks <= first:
            return []
        self._next_put_block[request_id] = num_full_blocks
        return [(block_hashes[index], block_ids[index]) for index in range(first, num_full_blocks)]

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for request_id in connector_output.finished_recving:
            order = self._loading.pop(request_id, None)
            if order is None or request_id not in self._next_put_block:
                continue
            # The blocks that did not arrive are recomputed: store them again (over a corrupted value).
            first_invalid = next((index for index, block_id in enumerate(order.local_block_ids)
                                  if block_id in connector_output.invalid_block_ids), None)
            if first_invalid is not None:
                self._next_put_block[request_id] = min(self._next_put_block[request_id],
                                                       order.first_block_index + first_invalid)

    def recomputes_failed_loads(self, request_id: str) -> bool:
        # A pool is a cache: a block it lost or holds corrupted is recomputed, never an error.
        return True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        for state in (self._matches, self._requests, self._block_ids, self._next_put_block):
            state.pop(request_id, None)
        # The worker may still be writing into its blocks: they are freed when the load is reported ended.
        return request_id in self._loading, None

    def shutdown(self) -> None:
        if self.connection is not None:
            self.connection.close()
