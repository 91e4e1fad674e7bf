"""KVCacheManager: per-request block tables on top of the block pool, with prefix caching.

The scheduler talks to this class only, and only in tokens and opaque `KVCacheBlocks`; it never
touches block internals. Block tables are append-only: a request's blocks are only ever extended,
never replaced, until the request is freed (finished or preempted).

Sliding-window models currently get full-attention allocation: every block of the sequence is kept,
including the ones that have slid out of the window. That is correct (the attention backend masks by
window) but costs memory; freeing out-of-window blocks is a later optimisation.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedserve.core.block_hash import update_request_block_hashes
from pagedserve.core.block_pool import BlockPool, KVCacheBlock
from pagedserve.core.request import Request


@dataclass
class KVCacheBlocks:
    """An opaque list of blocks handed to the scheduler (it only reads their ids)."""

    blocks: list[KVCacheBlock] = field(default_factory=list)

    def get_block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks)


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache counters, in tokens."""

    queries: int = 0  # tokens of the requests looked up
    hits: int = 0  # tokens served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Allocates, shares (prefix cache) and frees the KV blocks of requests."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be an integer >= 1")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # request id -> its block table (logical block i of the sequence is blocks[i]).
        self.request_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many of its leading blocks are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest chain of cached full blocks that prefixes the request's tokens.

        Returns the hit blocks (not yet referenced: pass them to `allocate_slots`) and the number of
        tokens they cover. The hit never covers every token: the last token must be computed so that
        there are logits to sample from. No lookup happens when caching is off or when the request
        wants prompt logprobs (those need every prompt position computed).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return KVCacheBlocks(), 0
        block_hashes = update_request_block_hashes(request, self.block_size)
        max_num_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_num_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit_blocks.append(block)
        num_hit_tokens = len(hit_blocks) * self.block_size
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens
        return KVCacheBlocks(hit_blocks), num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Make room for `num_new_tokens` more tokens of `request` after its computed ones.

        `new_computed_blocks` / `num_new_computed_tokens` are a prefix hit from `get_computed_blocks`
        (first admission only); they are referenced and appended to the block table first. Returns the
        newly allocated blocks, or None when the free blocks do not suffice (nothing changes then).
        Full blocks are registered in the prefix cache as soon as they are allocated: their KV is
        written by the step that computes them, before any later step can read it.
        `num_lookahead_tokens` more slots are reserved past the new tokens (a draft model writes KV there);
        they are never registered in the prefix cache. `delay_cache_blocks`: register none of the new blocks
        (their KV arrives from another engine later; they are registered by the first step after it arrived).
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(f"num_new_tokens={num_new_tokens} and num_lookahead_tokens={num_lookahead_tokens} "
                             f"must be >= 0")
        hit_blocks = new_computed_blocks.blocks if new_computed_blocks is not None else []
        blocks = self.request_to_blocks.get(request.request_id, [])
        num_computed_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_tokens_needing_slots = num_computed_after + num_lookahead_tokens
        if blocks and not hit_blocks and num_tokens_needing_slots <= len(blocks) * self.block_size:
            # The request's blocks already hold the new tokens (most decode steps): nothing to allocate,
            # only newly completed blocks to register, as in the general path below.
            if self.enable_caching:
                self._cache_full_blocks(request, min(num_computed_after, request.num_tokens))
            return KVCacheBlocks([])
        if hit_blocks and blocks:
            raise ValueError(f"request {request.request_id!r} already has blocks; prefix hits apply at admission only")

        num_blocks_needed = -(-num_tokens_needing_slots // self.block_size)
        num_blocks_to_allocate = max(0, num_blocks_needed - len(blocks) - len(hit_blocks))
        # Hit blocks that are free now leave the free queue when touched, so they count against it.
        num_free_hit_blocks = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        if num_blocks_to_allocate + num_free_hit_blocks > self.block_pool.get_num_free_blocks():
            return None

        if not blocks:
            self.request_to_blocks[request.request_id] = blocks
        if hit_blocks:
            # Touch before allocating so the hits cannot be handed out as new blocks.
            self.block_pool.touch(hit_blocks)
            blocks.extend(hit_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_blocks_to_allocate)
        blocks.extend(new_blocks)

        if self.enable_caching and not delay_cache_blocks:
            self._cache_full_blocks(request, min(num_computed_after, request.num_tokens))
        return KVCacheBlocks(new_blocks)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        num_full_blocks = num_tokens // self.block_size
        num_cached_blocks = self.num_cached_blocks.get(request.request_id, 0)
        if num_full_blocks <= num_cached_blocks:
            return
        block_hashes = update_request_block_hashes(request, self.block_size)
        self.block_pool.cache_full_blocks(
            self.request_to_blocks[request.request_id], block_hashes, num_cached_blocks, num_full_blocks)
        self.num_cached_blocks[request.request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so that a sequence's tail is evicted before its prefix.

        Blocks registered in the prefix cache whose KV was never fully computed (a request preempted in
        the same step that allocated them) are dropped from the cache, so nobody can hit stale KV.
        """
        blocks = self.request_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        num_valid_blocks = request.num_computed_tokens // self.block_size
        for block in blocks[num_valid_blocks:]:
            if block.ref_cnt == 1:
                self.block_pool.evict_cached_block(block)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids_of_positions(self, request_id: str, start: int, end: int) -> list[int]:
        """Ids of the request's blocks holding token positions [start, end) (the blocks a step writes)."""
        if end <= start:
            return []
        blocks = self.request_to_blocks.get(request_id, [])
        return [block.block_id for block in blocks[start // self.block_size:(end - 1) // self.block_size + 1]]

    def uncache_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop these blocks from the prefix cache (their KV was never written: a failed step)."""
        for block_id in block_ids:
            self.block_pool.evict_cached_block(self.block_pool.blocks[block_id])

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (empty for an unknown request)."""
        return [block.block_id for block in self.request_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; only possible while no request holds blocks. Returns success."""
        return self.block_pool.reset_prefix_cache()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """A snapshot of the cumulative prefix-cache counters (tokens queried, tokens hit)."""
        return PrefixCacheStats(self.prefix_cache_stats.queries, self.prefix_cache_stats.hits)
