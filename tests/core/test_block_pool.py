"""Block pool: null block, free queue order, ref counts, lazy eviction of cached blocks."""
from __future__ import annotations

import pytest

from pagedserve.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def test_free_queue_operations_keep_order_and_count() -> None:
    blocks = [KVCacheBlock(block_id) for block_id in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 6
    assert queue.popleft().block_id == 0
    queue.remove(blocks[3])
    assert ids(queue.get_all_free_blocks()) == [1, 2, 4, 5]
    queue.append(blocks[3])
    queue.append_n([blocks[0]])
    assert ids(queue.get_all_free_blocks()) == [1, 2, 4, 5, 3, 0]
    assert ids(queue.popleft_n(2)) == [1, 2]
    assert queue.num_free_blocks == 4
    queue.remove(blocks[0])  # the tail
    queue.remove(blocks[4])  # the head
    assert ids(queue.get_all_free_blocks()) == [5, 3]
    assert ids(queue.popleft_n(2)) == [5, 3]
    assert queue.num_free_blocks == 0
    with pytest.raises(ValueError, match="empty"):
        queue.popleft()
    with pytest.raises(ValueError, match="num_blocks=1"):
        queue.popleft_n(1)
    with pytest.raises(ValueError, match="not in the free block queue"):
        queue.remove(blocks[2])


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    assert free_ids(pool) == [1, 2, 3, 4]
    assert ids(pool.get_new_blocks(4)) == [1, 2, 3, 4]
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError, match="num_blocks=1 exceeds the 0 free blocks"):
        pool.get_new_blocks(1)
    pool.free_blocks([pool.null_block])  # ignored
    assert pool.null_block.ref_cnt == 0 and pool.get_num_free_blocks() == 0


def test_num_blocks_is_validated() -> None:
    with pytest.raises(ValueError, match="num_blocks=1"):
        BlockPool(num_blocks=1, enable_caching=True)


def test_free_appends_in_the_given_order_and_allocation_pops_the_front() -> None:
    pool = BlockPool(num_blocks=8, enable_caching=False)
    first = pool.get_new_blocks(3)
    assert ids(first) == [1, 2, 3]
    assert [block.ref_cnt for block in first] == [1, 1, 1]
    assert pool.get_usage() == pytest.approx(3 / 7)
    pool.free_blocks(reversed(first))
    assert free_ids(pool) == [4, 5, 6, 7, 3, 2, 1]
    assert [block.ref_cnt for block in first] == [0, 0, 0]
    assert ids(pool.get_new_blocks(5)) == [4, 5, 6, 7, 3]


def test_shared_block_returns_to_the_free_queue_only_at_ref_cnt_zero() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and free_ids(pool) == [2, 3]
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and free_ids(pool) == [2, 3, 1]
    with pytest.raises(ValueError, match="ref_cnt=0"):
        pool.free_blocks([block])


def test_cached_block_stays_hittable_while_free_and_is_evicted_lazily_on_reuse() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [111, 222], num_cached_blocks=0, num_full_blocks=2)
    assert pool.get_cached_block(111) is blocks[0] and pool.get_cached_block(222) is blocks[1]
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1]
    # Still hittable while free.
    hit = pool.get_cached_block(111)
    assert hit is blocks[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and free_ids(pool) == [3, 2]
    # Reusing block 2 drops its hash entry.
    assert ids(pool.get_new_blocks(2)) == [3, 2]
    assert pool.get_cached_block(222) is None
    assert blocks[1].block_hash is None
    assert pool.get_cached_block(111) is blocks[0]


def test_blocks_with_the_same_hash_are_not_deduplicated() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], [5], 0, 1)
    pool.cache_full_blocks([second], [5], 0, 1)
    assert pool.cached_block_hash_to_block[5] == {1: first, 2: second}
    pool.free_blocks([first])
    pool.get_new_blocks(2)  # reuses block 3, then block 1: block 1's entry goes, block 2's stays
    assert pool.get_cached_block(5) is second


def test_caching_off_registers_nothing() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [9], 0, 1)
    assert pool.get_cached_block(9) is None and blocks[0].block_hash is None


def test_reset_prefix_cache_only_when_nothing_is_in_use() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [9], 0, 1)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(9) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(9) is None and blocks[0].block_hash is None


def test_reset_puts_used_blocks_first_in_the_free_queue() -> None:
    """After a reset the blocks handed out before are reused first (their memory is already written), in their
    previous order; the never-used ones follow, and the queue stays consistent."""
    pool = BlockPool(num_blocks=10, enable_caching=True)
    blocks = pool.get_new_blocks(4)  # 1, 2, 3, 4
    pool.cache_full_blocks(blocks, [11, 12, 13, 14], 0, 4)
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])  # LRU: to the back in this order
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [5, 6, 7, 8, 9, 3, 1, 4, 2]
    assert pool.reset_prefix_cache() is True
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [3, 1, 4, 2, 5, 6, 7, 8, 9]
    assert pool.get_num_free_blocks() == 9
    assert [b.block_id for b in pool.get_new_blocks(5)] == [3, 1, 4, 2, 5]
    pool.touch([pool.blocks[7]])  # removal from the middle still works on the rebuilt queue
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [6, 8, 9]
