"""PoolConnector, worker side: load a request's blocks from the KV pool and store the blocks each step completes.

Loads: one loader thread takes the step's load orders in turn, reads the blocks in one batch, checks each value
(pool_block_format.py: header, length, checksum) and writes the leading run of good blocks into the request's
blocks; the blocks from the first missing or bad one on are reported in invalid_block_ids and recomputed by the
scheduler (a bad value is also removed from the store, so that the recomputed block replaces it). Every order ends
in finished_recving. A request that finished in the scheduler meanwhile is not written (its blocks are held until
the order ends).
Stores: after the forward (wait_for_save) the step's completed blocks are copied out of the cache on the engine's
thread, so they may be freed or reused at once, and written by a background thread through a bounded queue; when
the queue is full the step's blocks are skipped (the engine never waits for the pool). A failed write marks the pool
down: no further writes until retry_interval_s has passed.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import torch

from pagedserve.attention.kv_page_layout import KVPageLayout
from pagedserve.config.kv_transfer import KVTransferConfig
from pagedserve.core.scheduler_output import KVConnectorOutput
from pagedserve.kv_transfer.connector_base import KVConnectorWorker
from pagedserve.kv_transfer.kv_page_regions import KVPageRegions
from pagedserve.kv_transfer.pool_block_format import (PoolBlockError, block_key, decode_block, encode_block,
                                                      layout_fingerprint)
from pagedserve.kv_transfer.pool_connector_scheduler import PoolConnectorMetadata, PoolLoadOrder
from pagedserve.kv_transfer.pool_store_connection import PoolStoreConnection

logger = logging.getLogger(__name__)

# Seconds the worker waits for its first connection to the pool at start.
CONNECT_WAIT_S = 2.0


class PoolConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, engine_signature: dict[str, Any]) -> None:
        self.config = config
        self.pool_config = config.pool_config
        self.fingerprint = layout_fingerprint(engine_signature)
        self.engine_signature = engine_signature
        self.regions: KVPageRegions | None = None
        self.connection: PoolStoreConnection | None = None
        self._lock = threading.Lock()
        self._finished_loads: set[str] = set()
        self._invalid_block_ids: set[int] = set()
        self._pending_ids: set[str] = set()
        self._cancelled_ids: set[str] = set()
        self._loads: queue.Queue[PoolLoadOrder | None] = queue.Queue()
        self._puts: queue.Queue[tuple[list[int], torch.Tensor] | None] = queue.Queue(
            maxsize=max(1, self.pool_config.max_pending_puts))
        self._num_pending_put_blocks = 0
        self._step_puts: list[tuple[int, int]] = []
        self._threads: list[threading.Thread] = []
        # Cumulative counters (benchmarks, tests): blocks loaded, stored, found bad, and skipped stores.
        self.num_loaded_blocks = 0
        self.num_stored_blocks = 0
        self.num_bad_blocks = 0
        self.num_skipped_put_blocks = 0
        self.load_seconds = 0.0
        self.put_seconds = 0.0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], page_layouts: dict[str, KVPageLayout],
                           num_blocks: int) -> None:
        self.regions = KVPageRegions.build(kv_caches, page_layouts, num_blocks, self.engine_signature)
        self.block_bytes = sum(self.regions.region_bytes())
        self.connection = PoolStoreConnection(self.pool_config, self.pool_config.transfer_timeout_s,
                                              lends_memory=True, owner="worker")
        self.connection.wait_connected(min(CONNECT_WAIT_S, self.pool_config.transfer_timeout_s))
        if self.config.is_consumer:
            self._threads.append(threading.Thread(target=self._load_orders, name="pagedserve-kv-pool-loader",
                                                  daemon=True))
        if self.config.is_producer:
            self._threads.append(threading.Thread(target=self._store_blocks, name="pagedserve-kv-pool-writer",
                                                  daemon=True))
        for thread in self._threads:
            thread.start()

    # ---- the step ----------------------------------------------------------------------------------------------
    def start_load_kv(self, metadata: Any) -> None:
        if not isinstance(metadata, PoolConnectorMetadata):
            return
        with self._lock:
            self._pending_ids.update(order.request_id for order in metadata.loads)
            self._cancelled_ids.update(self._pending_ids.intersection(metadata.finished_request_ids))
        for order in metadata.loads:
            self._loads.put(order)
        self._step_puts = metadata.puts

    def wait_for_save(self) -> None:
        puts, self._step_puts = self._step_puts, []
        if not puts or self.regions is None or self.connection is None:
            return
        if not self.connection.is_available or self._puts.full():
            with self._lock:
                self.num_skipped_put_blocks += len(puts)
            return
        # One copy of the blocks' bytes ([blocks, every region of every layer]), on the host: the write thread
        # reads only this copy, never the cache.
        copy = torch.cat([source.reshape(len(puts), -1) for source in
                          self.regions.gather([block_id for _, block_id in puts])], dim=1).cpu()
        self._puts.put_nowait(([block_hash for block_hash, _ in puts], copy))

    def get_finished(self, finished_request_ids: set[str]) -> KVConnectorOutput:
        with self._lock:
            output = KVConnectorOutput(finished_recving=self._finished_loads, invalid_block_ids=self._invalid_block_ids)
            self._finished_loads, self._invalid_block_ids = set(), set()
        return output

    # ---- stores ------------------------------------------------------------------------------------------------
    def _store_blocks(self) -> None:
        assert self.connection is not None
        while True:
            item = self._puts.get()
            if item is None:
                self._puts.task_done()
                return
            try:
                self._store(*item)
            finally:
                self._puts.task_done()

    def _store(self, block_hashes: list[int], copy: torch.Tensor) -> None:
        assert self.connection is not None
        if not self.connection.is_available:
            with self._lock:
                self.num_skipped_put_blocks += len(block_hashes)
            return
        start = time.perf_counter()
        rows = copy.numpy()
        values = [(block_key(self.fingerprint, block_hash), encode_block(block_hash, rows[index]))
                  for index, block_hash in enumerate(block_hashes)]
        is_stored = self.connection.call(lambda store: store.put(values) or True) is not None
        with self._lock:
            if is_stored:
                self.num_stored_blocks += len(values)
                self.put_seconds += time.perf_counter() - start
            else:  # the connection marked the pool down: later items are skipped until it is retried
                self.num_skipped_put_blocks += len(values)

    def wait_for_stores(self, timeout_s: float) -> bool:
        """Wait until every queued block is written (or skipped); True when the queue drained in time."""
        deadline = time.monotonic() + timeout_s
        while self._puts.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._puts.unfinished_tasks

    # ---- loads -------------------------------------------------------------------------------------------------
    def _load_orders(self) -> None:
        while True:
            order = self._loads.get()
            if order is None:
                return
            num_loaded = 0
            try:
                num_loaded = self._load(order)
            except Exception:  # a load that fails for any reason recomputes; it must not end the loader
                logger.exception("request %s: KV pool load failed", order.request_id)
            with self._lock:
                self._pending_ids.discard(order.request_id)
                self._cancelled_ids.discard(order.request_id)
                self._finished_loads.add(order.request_id)
                self._invalid_block_ids.update(order.local_block_ids[num_loaded:])

    def _load(self, order: PoolLoadOrder) -> int:
        """Write the leading good blocks of the order into its blocks; returns how many (0: none, or cancelled)."""
        assert self.regions is not None and self.connection is not None
        if self._is_cancelled(order.request_id):
            return 0
        start = time.perf_counter()
        keys = [block_key(self.fingerprint, block_hash) for block_hash in order.block_hashes]
        values = self.connection.call(lambda store: store.get(keys))
        if values is None:
            return 0
        payloads: list[memoryview] = []
        for key, block_hash, value in zip(keys, order.block_hashes, values):
            if value is None:
                logger.info("request %s: block %s left the KV pool before it was read; recomputing from it",
                            order.request_id, key)
                break
            try:
                payloads.append(decode_block(value, block_hash, self.block_bytes))
            except PoolBlockError as error:
                logger.warning("request %s: KV pool block %s is bad (%s); recomputing from it and removing it",
                               order.request_id, key, error)
                with self._lock:
                    self.num_bad_blocks += 1
                self.connection.call(lambda store: store.remove(key))
                break
        if not payloads or self._is_cancelled(order.request_id):
            return 0
        rows = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(len(payloads), -1)
        sources, offset = [], 0
        for width in self.regions.region_bytes():
            sources.append(rows[:, offset:offset + width])
            offset += width
        self.regions.scatter(order.local_block_ids[:len(payloads)], sources)
        with self._lock:
            self.num_loaded_blocks += len(payloads)
            self.load_seconds += time.perf_counter() - start
        return len(payloads)

    def _is_cancelled(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._cancelled_ids

    def shutdown(self) -> None:
        for item_queue in (self._loads, self._puts):
            try:
                item_queue.put(None, timeout=self.pool_config.transfer_timeout_s)
            except queue.Full:
                pass
        for thread in self._threads:
            thread.join(timeout=self.pool_config.transfer_timeout_s * 2)
        self._threads = []
        if self.connection is not None:
            self.connection.close()
