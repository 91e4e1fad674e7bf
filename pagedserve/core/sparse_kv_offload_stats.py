"""SparseKVOffloadStats: the worker's sparse KV offload counters (pagedserve/sparse_kv_offload/), reported to the
engine with each step's output and exposed in SchedulerStats."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SparseKVOffloadStats:
    # Cumulative, summed over layers and requests: selected blocks found resident, selected blocks not resident,
    # blocks copied from the tier into a resident buffer (one per miss), resident blocks replaced (LRU), latent
    # rows written through to the tier, and decode gathers that needed more than one round (the selection
    # spanned more blocks than the buffer holds).
    num_block_hits: int = 0
    num_block_misses: int = 0
    num_blocks_moved_in: int = 0
    num_blocks_evicted: int = 0
    num_tokens_moved_out: int = 0
    num_multi_round_gathers: int = 0
    # Gauges: blocks held in resident buffers, and the (request, layer) buffers allocated.
    num_resident_blocks: int = 0
    num_resident_buffers: int = 0

    @property
    def hit_rate(self) -> float:
        lookups = self.num_block_hits + self.num_block_misses
        return self.num_block_hits / lookups if lookups else 0.0


__all__ = ["SparseKVOffloadStats"]
