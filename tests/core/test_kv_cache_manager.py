"""KV cache manager: exact block tables, prefix hits, the whole-prompt cap, eviction order, stats."""
from __future__ import annotations

import pytest

from pagedserve.core.block_hash import update_request_block_hashes
from pagedserve.core.kv_cache_manager import KVCacheBlocks, KVCacheManager

BLOCK_SIZE = 4


def free_ids(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.block_pool.free_block_queue.get_all_free_blocks()]


def ref_counts(manager: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [manager.block_pool.blocks[block_id].ref_cnt for block_id in block_ids]


def run_prefill(manager: KVCacheManager, request) -> KVCacheBlocks:
    """Admit `request` as the scheduler would and mark its whole prompt computed."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits, num_hit_tokens)
    assert new_blocks is not None
    request.num_computed_tokens = request.num_tokens
    return new_blocks


def test_allocation_gives_exact_block_ids_and_grows_by_whole_blocks(make_request) -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=False)
    request = make_request("r", list(range(10)))
    assert manager.allocate_slots(request, 10).get_block_ids() == [1, 2, 3]
    request.num_computed_tokens = 10
    request.append_output_token_ids([100])
    assert manager.allocate_slots(request, 1).get_block_ids() == []  # position 10 fits block 3
    request.num_computed_tokens = 11
    request.append_output_token_ids([101])
    assert manager.allocate_slots(request, 1).get_block_ids() == []
    request.num_computed_tokens = 12
    request.append_output_token_ids([102])
    assert manager.allocate_slots(request, 1).get_block_ids() == [4]
    assert manager.get_block_ids("r") == [1, 2, 3, 4]
    assert manager.num_free_blocks == 5
    assert manager.usage == pytest.approx(4 / 9)


def test_allocation_failure_changes_nothing(make_request) -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, enable_caching=True)
    holder = make_request("holder", list(range(8)))
    assert manager.allocate_slots(holder, 8).get_block_ids() == [1, 2]
    big = make_request("big", list(range(100, 109)))
    assert manager.allocate_slots(big, 9) is None
    assert manager.get_block_ids("big") == []
    assert manager.num_free_blocks == 1 and free_ids(manager) == [3]


def test_shared_prefix_hits_and_ref_counts(make_request) -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=True)
    first = make_request("a", list(range(10)))
    assert run_prefill(manager, first).get_block_ids() == [1, 2, 3]

    second = make_request("b", list(range(8)) + [50, 51, 52])
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert hits.get_block_ids() == [1, 2] and num_hit_tokens == 8
    assert ref_counts(manager, [1, 2]) == [1, 1]  # a lookup takes no reference
    new_blocks = manager.allocate_slots(second, 3, hits, num_hit_tokens)
    assert new_blocks.get_block_ids() == [4]
    assert manager.get_block_ids("b") == [1, 2, 4]
    assert ref_counts(manager, [1, 2, 3, 4]) == [2, 2, 1, 1]

    stats = manager.make_prefix_cache_stats()
    assert (stats.queries, stats.hits) == (10 + 11, 0 + 8)
    assert stats.hit_rate == pytest.approx(8 / 21)


@pytest.mark.parametrize(("prompt_length", "expected_hit_block_ids"), [(8, [1]), (9, [1, 2]), (7, [1]), (4, [])])
def test_hit_never_covers_the_whole_prompt(make_request, prompt_length, expected_hit_block_ids) -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=True)
    run_prefill(manager, make_request("a", list(range(12))))
    again = make_request("b", list(range(prompt_length)))
    hits, num_hit_tokens = manager.get_computed_blocks(again)
    assert hits.get_block_ids() == expected_hit_block_ids
    assert num_hit_tokens == BLOCK_SIZE * len(expected_hit_block_ids)
    assert num_hit_tokens < prompt_length


def test_no_lookup_without_caching_or_with_prompt_logprobs(make_request) -> None:
    cached = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=True)
    run_prefill(cached, make_request("a", list(range(12))))
    wants_prompt_logprobs = make_request("b", list(range(12)), prompt_logprobs=1)
    assert cached.get_computed_blocks(wants_prompt_logprobs)[1] == 0
    assert cached.make_prefix_cache_stats().queries == 12  # only the first request's lookup

    uncached = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=False)
    run_prefill(uncached, make_request("a", list(range(12))))
    assert uncached.get_computed_blocks(make_request("c", list(range(12))))[1] == 0
    assert uncached.block_pool.cached_block_hash_to_block == {}
    assert uncached.make_prefix_cache_stats().queries == 0


def test_free_releases_the_tail_first(make_request) -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=True)
    request = make_request("a", list(range(12)))
    run_prefill(manager, request)
    assert manager.get_block_ids("a") == [1, 2, 3]
    manager.free(request)
    assert manager.get_block_ids("a") == []
    assert free_ids(manager) == [4, 5, 6, 7, 3, 2, 1]
    assert ref_counts(manager, [1, 2, 3]) == [0, 0, 0]
    # The never-used blocks go first, then the freed sequence from its tail.
    other = make_request("b", list(range(100, 120)))
    assert manager.allocate_slots(other, 20).get_block_ids() == [4, 5, 6, 7, 3]


def test_freed_blocks_stay_hittable_until_reused(make_request) -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE, enable_caching=True)
    first = make_request("a", list(range(13)))
    run_prefill(manager, first)
    manager.free(first)
    assert free_ids(manager) == [5, 4, 3, 2, 1]  # blocks 1-4 taken, then freed tail first

    # Lazy eviction: the freed blocks are still hits.
    second = make_request("b", list(range(13)))
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert hits.get_block_ids() == [1, 2, 3] and num_hit_tokens == 12
    manager.free(second)  # never allocated: a no-op

    # A request that needs 3 blocks takes 5, 4 and 3 from the front: block 3 loses its hash.
    filler = make_request("c", list(range(200, 212)))
    assert manager.allocate_slots(filler, 12).get_block_ids() == [5, 4, 3]
    hits, num_hit_tokens = manager.get_computed_blocks(make_request("d", list(range(13))))
    assert hits.get_block_ids() == [1, 2] and num_hit_tokens == 8


def test_free_hit_blocks_count_against_the_free_blocks(make_request) -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, enable_caching=True)
    first = make_request("a", list(range(9)))
    run_prefill(manager, first)  # blocks 1, 2, 3
    manager.free(first)
    second = make_request("b", list(range(8)) + [90, 91, 92, 93, 94])  # 13 tokens: 4 blocks needed
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert hits.get_block_ids() == [1, 2]
    # Two hits (both free) plus two new blocks exceed the three usable blocks.
    assert manager.allocate_slots(second, 5, hits, num_hit_tokens) is None
    assert ref_counts(manager, [1, 2, 3]) == [0, 0, 0] and manager.num_free_blocks == 3
    # Fewer tokens fit: the hits are touched before the new block is taken, so they survive.
    assert manager.allocate_slots(second, 4, hits, num_hit_tokens).get_block_ids() == [3]
    assert manager.get_block_ids("b") == [1, 2, 3]
    assert ref_counts(manager, [1, 2, 3]) == [1, 1, 1]


def test_full_blocks_are_cached_as_they_are_allocated(make_request) -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=True)
    request = make_request("a", list(range(10)))
    manager.allocate_slots(request, 6)  # a first chunk: tokens 0-5
    hashes = update_request_block_hashes(request, BLOCK_SIZE)
    pool = manager.block_pool
    assert pool.get_cached_block(hashes[0]).block_id == 1
    assert pool.get_cached_block(hashes[1]) is None
    request.num_computed_tokens = 6
    manager.allocate_slots(request, 4)
    assert pool.get_cached_block(hashes[1]).block_id == 2
    # Output tokens fill blocks too.
    request.num_computed_tokens = 10
    request.append_output_token_ids([70, 71])
    manager.allocate_slots(request, 2)
    hashes = update_request_block_hashes(request, BLOCK_SIZE)
    assert len(hashes) == 3 and pool.get_cached_block(hashes[2]).block_id == 3


def test_free_uncaches_blocks_whose_kv_was_never_computed(make_request) -> None:
    # A request preempted in the step that allocated its blocks: their KV is never written.
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=True)
    request = make_request("a", list(range(13)))
    request.num_computed_tokens = 0
    manager.allocate_slots(request, 4)
    request.num_computed_tokens = 4  # block 1 computed
    manager.allocate_slots(request, 9)  # blocks 2, 3 (full) and 4 allocated for this step
    hashes = update_request_block_hashes(request, BLOCK_SIZE)
    assert [manager.block_pool.get_cached_block(h).block_id for h in hashes] == [1, 2, 3]
    manager.free(request)  # num_computed_tokens is still 4
    assert manager.block_pool.get_cached_block(hashes[0]).block_id == 1
    assert manager.block_pool.get_cached_block(hashes[1]) is None
    assert manager.block_pool.get_cached_block(hashes[2]) is None


def test_reset_prefix_cache(make_request) -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=True)
    request = make_request("a", list(range(9)))
    run_prefill(manager, request)
    assert manager.reset_prefix_cache() is False
    manager.free(request)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("b", list(range(9))))[1] == 0


def test_bad_arguments_raise(make_request) -> None:
    with pytest.raises(ValueError, match="block_size=0"):
        KVCacheManager(num_blocks=10, block_size=0, enable_caching=True)
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=True)
    with pytest.raises(ValueError, match="num_new_tokens=-1"):
        manager.allocate_slots(make_request("a", [1, 2]), -1)
