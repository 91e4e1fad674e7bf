"""The pool of physical KV blocks: reference counts, the LRU free queue and the prefix-cache index.

Invariants:
- Block 0 is the null block: a placeholder that is never handed out and never freed.
- A block is in the free queue exactly when its ref_cnt is 0 (and it is not the null block).
- A free block may still carry a block hash: its KV stays valid and can be hit until the block is
  handed out again (lazy eviction). The free queue order is the eviction order: front first.
- Blocks are never de-duplicated: two blocks may hold the same hash, so block tables stay append-only.
"""
from __future__ import annotations

from collections.abc import Iterable

from pagedserve.core.block_hash import BlockHash


class KVCacheBlock:
    """Metadata of one physical KV block (the tensors live in the worker)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block", "is_null", "was_used")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is registered in the prefix-cache index (it is full and its KV is valid).
        self.block_hash: BlockHash | None = None
        # Links of the free queue; None while the block is in use.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False
        # Set once the block is first handed out: its memory has been written (see reset_prefix_cache).
        self.was_used = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, block_hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with sentinel head and tail; every operation is O(1) per block.

    Blocks are popped from the front (least recently freed first) and appended at the back. The links
    live inside the blocks, so removing a block from the middle (a prefix hit on a free block) needs no
    search.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        previous = self._head
        for block in blocks:
            previous.next_free_block = block
            block.prev_free_block = previous
            previous = block
        previous.next_free_block = self._tail
        self._tail.prev_free_block = previous

    def popleft(self) -> KVCacheBlock:
        """Remove and return the first free block."""
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("popleft: the free block queue is empty")
        self._unlink(block)
        return block

    def popleft_n(self, num_blocks: int) -> list[KVCacheBlock]:
        """Remove and return the first `num_blocks` free blocks, front first."""
        if not 0 <= num_blocks <= self.num_free_blocks:
            raise ValueError(f"num_blocks={num_blocks} must be in [0, {self.num_free_blocks}] (the free blocks)")
        return [self.popleft() for _ in range(num_blocks)]

    def remove(self, block: KVCacheBlock) -> None:
        """Remove `block` from wherever it is in the queue."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise ValueError(f"remove: block {block.block_id} is not in the free block queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the back (evicted last)."""
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append `blocks` in the given order."""
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks front to back (for tests and debugging; O(n))."""
        blocks = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks

    def _unlink(self, block: KVCacheBlock) -> None:
        assert block.prev_free_block is not None and block.next_free_block is not None
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1


class BlockPool:
    """Hands out, shares and frees KV blocks, and indexes full blocks by hash for prefix caching."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks!r} must be an integer >= 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # hash -> {block_id: block}. Several blocks may share a hash (no de-duplication).
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, cached-but-unreferenced included)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) that are referenced."""
        num_usable_blocks = self.num_blocks - 1
        return 1.0 - self.get_num_free_blocks() / num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the front of the free queue, each with ref_cnt 1.

        A reused block that was still cached loses its hash entry now (lazy eviction).
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"num_blocks={num_blocks} exceeds the {self.get_num_free_blocks()} free blocks")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            self.evict_cached_block(block)
            block.ref_cnt = 1
            block.was_used = True
        return blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """A block holding `block_hash`, or None on a miss."""
        blocks = self.cached_block_hash_to_block.get(block_hash)
        if not blocks:
            return None
        return next(iter(blocks.values()))

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] of one request under their hashes.

        `block_hashes[i]` is the hash of `blocks[i]`. Blocks that already carry a hash (prefix hits)
        keep it.
        """
        if not self.enable_caching:
            return
        if len(block_hashes) < num_full_blocks or len(blocks) < num_full_blocks:
            raise ValueError(
                f"num_full_blocks={num_full_blocks} exceeds the {len(block_hashes)} hashes "
                f"or the {len(blocks)} blocks given"
            )
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.is_null:
                continue
            block_hash = block_hashes[index]
            if block.block_hash is not None:
                assert block.block_hash == block_hash, f"block {block.block_id} is cached under another hash"
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block

    def evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop `block` from the prefix-cache index; returns whether it was cached."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        block.block_hash = None
        same_hash_blocks = self.cached_block_hash_to_block.get(block_hash)
        if same_hash_blocks is not None:
            same_hash_blocks.pop(block.block_id, None)
            if not same_hash_blocks:
                del self.cached_block_hash_to_block[block_hash]
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit); a free block leaves the free queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue in the given order.

        The caller passes blocks in eviction order (first = evicted first).
        """
        # The null block is a shared placeholder: it is never counted, queued or freed.
        ordered = [block for block in ordered_blocks if not block.is_null]
        for block in ordered:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed with ref_cnt={block.ref_cnt}; allowed ref_cnt >= 1")
        for block in ordered:
            block.ref_cnt -= 1
        self.free_block_queue.append_n(block for block in ordered if block.ref_cnt == 0)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no block is in use; returns whether it happened.

        With no cached KV left, eviction order no longer matters, so the free queue is rebuilt with the blocks
        handed out before at the front (in their current order): they are reused first. Their memory is
        already written; a never-used block's first write faults its pages in (~0.6 ms per MiB of KV cache
        measured on the CPU), which a reset engine would otherwise pay again on fresh blocks.
        """
        num_used_blocks = self.num_blocks - 1 - self.get_num_free_blocks()
        if num_used_blocks != 0:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        free_blocks = self.free_block_queue.get_all_free_blocks()
        self.free_block_queue = FreeKVCacheBlockQueue([block for block in free_blocks if block.was_used]
                                                      + [block for block in free_blocks if not block.was_used])
        return True
