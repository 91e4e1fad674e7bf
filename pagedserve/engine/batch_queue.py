"""BatchQueue: the steps an engine core has in flight, oldest first (async scheduling; the seam
pipeline-parallel micro-batches use).

With `max_concurrent_batches` N > 1 the engine core schedules and submits steps while the queue has
room, then waits for the oldest. Executors run the steps of one engine in submission order, so the
outputs come back in that order, and each worker has applied step t (including appending the token it
sampled) before it starts step t+1.

A failed step must not leave wrong KV behind for later steps. Steps submitted after it may already
read KV it should have written: a request admitted later with a prefix-cache hit on a block the failed
step was filling (and, through its own freshly cached blocks, requests admitted after that one). So
each queued step records the KV blocks it writes per request (only with prefix caching: without it no
request ever reads another's blocks), and `poisoned_by` finds those readers and the blocks to uncache.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


@dataclass
class InFlightStep:
    scheduler_output: SchedulerOutput
    future: "Future[ModelRunnerOutput]"
    # request id -> ids of the KV blocks this step writes for it (empty without prefix caching).
    written_block_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class PoisonedRequests:
    """What a failed step invalidates beyond its own batch."""

    # Requests of later steps in flight that read KV the failed step (or another poisoned request)
    # should have written; they fail too.
    request_ids: list[str]
    # Blocks written by the failed step or by poisoned requests: they must leave the prefix cache.
    block_ids: set[int]


class BatchQueue:
    def __init__(self, max_concurrent_batches: int, kv_cache_manager: KVCacheManager) -> None:
        if not isinstance(max_concurrent_batches, int) or max_concurrent_batches < 2:
            raise ValueError(f"max_concurrent_batches={max_concurrent_batches!r} must be an integer >= 2 for a "
                             f"batch queue (1 runs steps one at a time, without a queue)")
        self.max_concurrent_batches = max_concurrent_batches
        self.kv_cache_manager = kv_cache_manager
        self._steps: deque[InFlightStep] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[InFlightStep]:
        return iter(self._steps)

    @property
    def is_full(self) -> bool:
        return len(self._steps) >= self.max_concurrent_batches

    def submit(self, scheduler_output: SchedulerOutput, future: "Future[ModelRunnerOutput]",
               requests: dict[str, Request]) -> InFlightStep:
        """Queue a step just scheduled (its requests' num_computed_tokens already include it)."""
        written: dict[str, list[int]] = {}
        if self.kv_cache_manager.enable_caching:
            for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
                end = requests[request_id].num_computed_tokens
                written[request_id] = self.kv_cache_manager.get_block_ids_of_positions(
                    request_id, end - num_tokens, end)
        step = InFlightStep(scheduler_output, future, written)
        self._steps.append(step)
        return step

    def pop_oldest(self) -> InFlightStep:
        return self._steps.popleft()

    def poisoned_by(self, failed: InFlightStep, block_size: int) -> PoisonedRequests:
        """Requests of the steps still queued (all later than `failed`) that read KV `failed` never
        wrote, transitively, and every block such KV sits in."""
        failed_ids = set(failed.scheduler_output.num_scheduled_tokens)
        poisoned_blocks = {block_id for block_ids in failed.written_block_ids.values() for block_id in block_ids}
        # The failed requests' later steps wrote garbage too (their attention read the missing KV).
        for step in self._steps:
            for request_id in failed_ids & step.written_block_ids.keys():
                poisoned_blocks.update(step.written_block_ids[request_id])
        poisoned_ids: list[str] = []
        for index, step in enumerate(self._steps):
            # Admission order: a request can only hit blocks of requests admitted before it.
            for new in step.scheduler_output.scheduled_new_requests:
                if new.request_id in failed_ids:
                    continue
                hit_block_ids = new.block_ids[:new.num_computed_tokens // block_size]
                if poisoned_blocks.isdisjoint(hit_block_ids):
                    continue
                failed_ids.add(new.request_id)
                poisoned_ids.append(new.request_id)
                for later in list(self._steps)[index:]:
                    poisoned_blocks.update(later.written_block_ids.get(new.request_id, ()))
        return PoisonedRequests(poisoned_ids, poisoned_blocks)

    def clear(self) -> None:
        self._steps.clear()
