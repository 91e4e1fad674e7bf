"""A KV pool store client that the engine can always ask without waiting long: it connects in the background,
and after a failure it stays "down" for retry_interval_s (callers get None and go on without the pool).

The pool going down is logged once, and coming back once, per process and store (an engine's scheduler and worker
side notice the same outage); an engine whose pool stays down serves as if it had none. Thread-safe.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from pagedserve.config.kv_pool import KVPoolConfig
from pagedserve.kv_transfer.pool_store import KVPoolStore, KVPoolStoreError, connect_pool_store

logger = logging.getLogger(__name__)
Result = TypeVar("Result")

# Stores (backend and url) this process has said are down and not yet said are back.
_reported_down_stores: set[str] = set()
_report_lock = threading.Lock()


class PoolStoreConnection:
    def __init__(self, config: KVPoolConfig, timeout_s: float, lends_memory: bool, owner: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`owner`: who uses the connection, for the log ("lookups", "worker")."""
        self.config = config
        self.timeout_s = timeout_s
        self.lends_memory = lends_memory
        self.owner = owner
        self.clock = clock
        self._lock = threading.Lock()
        self._store: KVPoolStore | None = None
        self._connecting: threading.Thread | None = None
        # When the pool may be tried again (0: now); set by a failure.
        self._retry_at = 0.0
        self._store_name = f"{config.backend} at {config.store_url}"
        self._is_closed = False
        self._start_connecting()

    def _start_connecting(self) -> None:
        self._connecting = threading.Thread(target=self._connect, name=f"pagedserve-kv-pool-{self.owner}",
                                            daemon=True)
        self._connecting.start()

    def _connect(self) -> None:
        try:
            store = connect_pool_store(self.config, self.timeout_s, self.lends_memory)
        except KVPoolStoreError as error:
            self.mark_down(str(error))
            with self._lock:
                self._connecting = None
            return
        except Exception as error:  # a client library's own failure must not end the engine
            self.mark_down(f"{type(error).__name__}: {error}")
            with self._lock:
                self._connecting = None
            return
        with self._lock:
            self._connecting = None
            if self._is_closed:
                store.close()
                return
            self._store = store
            self._retry_at = 0.0
        self._report_up()

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait for the first connection attempt (tests, benchmarks); True when connected."""
        thread = self._connecting
        if thread is not None:
            thread.join(timeout_s)
        return self._store is not None

    @property
    def is_available(self) -> bool:
        """Connected and not in a retry wait (starts a reconnection when its wait is over)."""
        with self._lock:
            if self._is_closed or self.clock() < self._retry_at:
                return False
            if self._store is None:
                if self._connecting is None:
                    self._start_connecting()
                return False
            return True

    def call(self, operation: Callable[[KVPoolStore], Result]) -> Result | None:
        """`operation(store)`, or None when the pool is down (a failure marks it down)."""
        if not self.is_available:
            return None
        store = self._store
        if store is None:
            return None
        try:
            result = operation(store)
        except KVPoolStoreError as error:
            self.mark_down(str(error))
            return None
        except Exception as error:
            self.mark_down(f"{type(error).__name__}: {error}")
            return None
        self._report_up()
        return result

    def mark_down(self, reason: str) -> None:
        """Stop using the pool for retry_interval_s (logged on the first failure only)."""
        with self._lock:
            self._retry_at = self.clock() + self.config.retry_interval_s
        with _report_lock:
            is_first = self._store_name not in _reported_down_stores
            _reported_down_stores.add(self._store_name)
        if is_first:
            logger.warning("KV pool (%s) unavailable to the %s: %s; serving without it (retried every %g s)",
                           self._store_name, self.owner, reason, self.config.retry_interval_s)
        else:
            logger.debug("KV pool (%s) unavailable to the %s: %s", self._store_name, self.owner, reason)

    def _report_up(self) -> None:
        if self._store_name not in _reported_down_stores:  # the common case, without the lock
            return
        with _report_lock:
            was_down = self._store_name in _reported_down_stores
            _reported_down_stores.discard(self._store_name)
        if was_down:
            logger.warning("KV pool (%s) available again", self._store_name)

    def close(self) -> None:
        with self._lock:
            self._is_closed = True
            store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except Exception:  # closing a client of a dead store may fail; nothing is left to release
                pass
