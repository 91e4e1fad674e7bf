"""ResidentBlockSet: the per-request LRU over resident blocks (vllm-ascend F4 CPU test (a) and (c), at block
granularity): hits kept, eviction order, misses = needed minus resident, rounds when a step needs more blocks
than the buffer holds, and a random-stream property check."""
from __future__ import annotations

import random

import pytest

from pagedserve.sparse_kv_offload.resident_block_set import ResidentBlockSet


def _loaded(plan) -> list[int]:
    return [block_id for residency_round in plan.rounds for block_id, _ in residency_round.loads]


def test_first_step_loads_every_block_into_free_slots() -> None:
    blocks = ResidentBlockSet(4)
    plan = blocks.plan([10, 11, 12])
    assert (plan.num_hits, plan.num_misses, plan.num_evictions) == (0, 3, 0)
    assert len(plan.rounds) == 1
    assert plan.rounds[0].loads == [(10, 0), (11, 1), (12, 2)]
    assert plan.rounds[0].resident == {10: 0, 11: 1, 12: 2}


def test_hits_are_kept_and_the_least_recently_used_block_is_evicted() -> None:
    blocks = ResidentBlockSet(3)
    blocks.plan([1, 2, 3])
    blocks.plan([1])  # 1 becomes the most recent: 2 is now the least recently used
    plan = blocks.plan([1, 4])
    assert (plan.num_hits, plan.num_misses, plan.num_evictions) == (1, 1, 1)
    assert plan.rounds[0].loads == [(4, 1)]  # 2's slot
    assert plan.rounds[0].resident == {1: 0, 4: 1}
    assert 2 not in blocks and {1, 3, 4} == set(blocks.slot_of_block)


def test_misses_are_the_needed_blocks_not_resident() -> None:
    blocks = ResidentBlockSet(8)
    blocks.plan([5, 6, 7])
    plan = blocks.plan([6, 7, 8, 9])
    assert plan.num_hits == 2 and plan.num_misses == 2 and _loaded(plan) == [8, 9]


def test_more_needed_blocks_than_slots_take_several_rounds() -> None:
    blocks = ResidentBlockSet(2)
    blocks.plan([1])
    plan = blocks.plan([1, 2, 3, 4, 5])
    assert plan.num_hits == 1 and plan.num_misses == 4
    # Round 0: the hit and one load in the free slot; then two loads per round, evicting earlier rounds' blocks.
    assert [sorted(r.resident) for r in plan.rounds] == [[1, 2], [3, 4], [5]]
    assert plan.num_evictions == 3
    assert sorted(blocks.slot_of_block) == [4, 5]


def test_capacity_must_be_positive_and_blocks_distinct() -> None:
    with pytest.raises(ValueError, match="capacity=0"):
        ResidentBlockSet(0)
    with pytest.raises(ValueError, match="distinct"):
        ResidentBlockSet(2).plan([3, 3])


@pytest.mark.parametrize("capacity", [1, 3, 8])
def test_random_streams_keep_every_needed_block_resident_in_its_round(capacity: int) -> None:
    rng = random.Random(capacity)
    blocks = ResidentBlockSet(capacity)
    for _ in range(200):
        needed = rng.sample(range(24), rng.randint(1, 10))
        before = set(blocks.slot_of_block)
        plan = blocks.plan(needed)
        assert plan.num_misses == len(set(needed) - before)
        assert plan.num_hits == len(set(needed) & before)
        seen: set[int] = set()
        for residency_round in plan.rounds:
            slots = list(residency_round.resident.values())
            assert len(set(slots)) == len(slots) <= capacity  # one block per slot within a round
            assert all(0 <= slot < capacity for slot in slots)
            seen |= set(residency_round.resident)
        assert seen == set(needed)
        if len(needed) <= capacity:
            assert len(plan.rounds) == 1  # a selection that fits never takes a second round
        slots = list(blocks.slot_of_block.values())
        assert len(set(slots)) == len(slots) <= capacity  # slot_of_block stays injective
