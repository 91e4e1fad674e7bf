"""Long random runs of the scheduler against a mirror of the worker and of the KV contents.

Each run adds requests with shared prefixes, samples random tokens (EOS included), aborts at random
(also between schedule() and update_from_output()), and checks after every step:
- the token budget, max_num_seqs and progress;
- the NewRequestData / CachedRequestData deltas rebuild exactly the manager's block tables;
- every KV slot a request attends to holds what that request's own tokens would have written there
  (so prefix hits, lazy eviction and preemption never expose stale KV);
- block ref counts equal the number of tables holding the block, and the free queue holds exactly the
  unreferenced blocks.
At the end every block is free with ref_cnt 0.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest

from pagedserve.core.request import RequestStatus
from pagedserve.core.scheduler_output import LogprobsLists, ModelRunnerOutput

BLOCK_SIZE = 4
NUM_BLOCKS = 11
MAX_MODEL_LEN = 32
EOS = 0
PREFIXES = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [21, 22, 23, 24, 25], [31, 32]]


class WorkerMirror:
    """What a worker would hold: block tables and computed counts, fed only by scheduler outputs."""

    def __init__(self) -> None:
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed_tokens: dict[str, int] = {}
        self.token_ids: dict[str, list[int]] = {}
        # block id -> per slot: identity of the prefix whose last token's KV was written there.
        self.kv_slots: dict[int, list[object]] = {}

    def apply(self, scheduler, scheduler_output) -> None:
        for request_id in scheduler_output.finished_request_ids | scheduler_output.preempted_request_ids:
            self.block_tables.pop(request_id, None)
            self.num_computed_tokens.pop(request_id, None)
            self.token_ids.pop(request_id, None)
        for new in scheduler_output.scheduled_new_requests:
            assert new.request_id not in self.block_tables
            self.block_tables[new.request_id] = list(new.block_ids)
            self.num_computed_tokens[new.request_id] = new.num_computed_tokens
            self.token_ids[new.request_id] = list(new.token_ids)
        cached = scheduler_output.scheduled_cached_requests
        for request_id, new_block_ids, num_computed in zip(
                cached.request_ids, cached.new_block_ids, cached.num_computed_tokens):
            assert request_id in self.block_tables, "a delta for a request the worker does not hold"
            assert num_computed == self.num_computed_tokens[request_id]
            self.block_tables[request_id].extend(new_block_ids)
            self.token_ids[request_id] = scheduler.requests[request_id].all_token_ids

        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            table = self.block_tables[request_id]
            assert table == scheduler.kv_cache_manager.get_block_ids(request_id)
            tokens = self.token_ids[request_id]
            start = self.num_computed_tokens[request_id]
            assert len(table) * BLOCK_SIZE >= start + num_tokens
            for position in range(start):  # attended KV must be this request's own
                assert self._slot(table, position) == tuple(tokens[:position + 1]), (request_id, position)
            for position in range(start, start + num_tokens):
                self.kv_slots.setdefault(table[position // BLOCK_SIZE], [None] * BLOCK_SIZE)[
                    position % BLOCK_SIZE] = tuple(tokens[:position + 1])
            self.num_computed_tokens[request_id] = start + num_tokens

    def _slot(self, table: list[int], position: int) -> object:
        return self.kv_slots.get(table[position // BLOCK_SIZE], [None] * BLOCK_SIZE)[position % BLOCK_SIZE]


def check_block_accounting(scheduler) -> None:
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    holders = Counter(block.block_id for blocks in manager.request_to_blocks.values() for block in blocks)
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id], block
    free = {block.block_id for block in pool.free_block_queue.get_all_free_blocks()}
    assert free == {block.block_id for block in pool.blocks[1:] if block.ref_cnt == 0}
    assert pool.get_num_free_blocks() == len(free)
    for block_hash, blocks in pool.cached_block_hash_to_block.items():
        assert all(block.block_hash == block_hash for block in blocks.values())
    assert set(manager.request_to_blocks) <= set(scheduler.requests)


def random_request(rng: random.Random, make_request, request_id: str):
    prompt = list(rng.choice(PREFIXES))[:rng.randint(1, 9)] + [rng.randint(1, 9) for _ in range(rng.randint(0, 12))]
    return make_request(
        request_id, prompt, eos_token_id=EOS, max_tokens=rng.randint(1, 20), min_tokens=0,
        priority=rng.randint(0, 3), prompt_logprobs=1 if rng.random() < 0.1 else None,
        stop_token_ids=[9] if rng.random() < 0.2 else None,
    )


@pytest.mark.parametrize(("seed", "policy", "enable_caching", "enable_chunked_prefill", "long_prefill_token_threshold"), [
    (0, "fcfs", True, True, 0),
    (1, "fcfs", False, True, 0),
    (2, "priority", True, True, 0),
    (3, "fcfs", True, False, 0),
    (4, "priority", False, False, 0),
    (5, "priority", True, True, 8),
    (6, "fcfs", True, True, 3),
])
def test_random_run_keeps_invariants_and_frees_every_block(
        make_scheduler, make_request, seed, policy, enable_caching, enable_chunked_prefill,
        long_prefill_token_threshold):
    rng = random.Random(seed)
    budget = 16 if enable_chunked_prefill else MAX_MODEL_LEN
    scheduler = make_scheduler(
        num_blocks=NUM_BLOCKS, enable_caching=enable_caching, policy=policy, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=budget, max_num_seqs=6, enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold)
    worker = WorkerMirror()
    num_added, num_to_add = 0, 150
    done: set[str] = set()
    num_steps = 0

    while num_added < num_to_add or scheduler.has_unfinished_requests():
        num_steps += 1
        assert num_steps < 2000, "the scheduler stopped making progress"
        for _ in range(rng.choice([0, 1, 1, 2])):
            if num_added < num_to_add:
                scheduler.add_request(random_request(rng, make_request, f"r{num_added}"))
                num_added += 1
        if scheduler.requests and rng.random() < 0.08:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            done.add(victim)

        had_work = scheduler.has_unfinished_requests()
        scheduler_output = scheduler.schedule()
        assert scheduler_output.total_num_scheduled_tokens == sum(scheduler_output.num_scheduled_tokens.values())
        assert scheduler_output.total_num_scheduled_tokens <= budget
        assert len(scheduler.running) <= 6
        if had_work:
            assert scheduler_output.total_num_scheduled_tokens > 0 or scheduler_output.preempted_request_ids
        worker.apply(scheduler, scheduler_output)
        check_block_accounting(scheduler)

        if scheduler.requests and rng.random() < 0.03:  # an abort while the step runs
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            done.add(victim)

        request_ids, sampled, prompt_logprobs = [], [], {}
        for request_id in scheduler_output.num_scheduled_tokens:
            request = scheduler.requests.get(request_id)
            caught_up = request is not None and request.num_computed_tokens == request.num_tokens
            request_ids.append(request_id)
            sampled.append([rng.randint(0, 9)] if caught_up else [])
            if request is not None and request.sampling_params.prompt_logprobs is not None:
                prompt_logprobs[request_id] = LogprobsLists([[1]], [[-1.0]], [1])
        outputs = scheduler.update_from_output(
            scheduler_output, ModelRunnerOutput(request_ids, sampled, prompt_logprobs=prompt_logprobs))
        for output in outputs:
            assert output.request_id not in done, "output after the request finished"
            if output.finished:
                done.add(output.request_id)
        check_block_accounting(scheduler)

    assert done == {f"r{index}" for index in range(num_to_add)}
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert scheduler.kv_cache_manager.request_to_blocks == {}
    assert scheduler.make_stats().kv_cache_usage == 0.0
    assert scheduler.make_stats().num_preemptions > 0
    if enable_caching:
        assert scheduler.make_stats().prefix_cache_hits > 0
