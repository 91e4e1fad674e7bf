"""LayerResidentBuffers: one offloaded DSA layer's resident buffers, one per decoding request, and the decode gather
that reads the selected latent rows through them (the seam SparseMLAAttention.decode_row_gather).

Per decode row (one request's new token): the indexer's selection names token positions; their blocks (through the
request's block table) are made resident by the request's ResidentBlockSet (LRU); only the missing blocks are copied
from the tier, and the selected rows are then gathered from the buffer, round by round when the selection spans
more blocks than the buffer holds. The rows come back in the selection's order, as copies of the tier's rows, so
the attention that follows sees exactly the values the plain gather (attention/sparse_mla.gather_selected_rows)
reads from a resident cache; unselected entries (-1) are zeros, which attention masks out.

The new token's row is written to the tier before the gather (write-through); when its block is resident the row
is copied into the buffer too, so a resident block never lags the tier. A request's buffers are dropped when it
finishes, is preempted, or computes several tokens in one step (SparseKVOffload.begin_step).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.sparse_mla import gather_selected_rows
from pagedserve.core.sparse_kv_offload_stats import SparseKVOffloadStats
from pagedserve.sparse_kv_offload.resident_block_set import ResidentBlockSet


@dataclass
class StepRequests:
    """The request id of each attention-metadata row of the current step (set by SparseKVOffload.begin_step)."""

    request_ids: list[str] = field(default_factory=list)


class LayerResidentBuffers:
    def __init__(self, tier_rows: torch.Tensor, capacity: int, step: StepRequests,
                 stats: SparseKVOffloadStats) -> None:
        """`tier_rows` [num_blocks, block_size, width]: the layer's latent rows in the tier; `capacity`: blocks per
        request's buffer."""
        self.tier_rows = tier_rows
        self.capacity = capacity
        self.step = step
        self.stats = stats
        # request id -> (its resident block set, its buffer [capacity, block_size, width]).
        self.buffers: dict[str, tuple[ResidentBlockSet, torch.Tensor]] = {}

    @property
    def num_resident_blocks(self) -> int:
        return sum(len(block_set) for block_set, _ in self.buffers.values())

    def free(self, request_ids: set[str] | list[str]) -> None:
        for request_id in request_ids:
            self.buffers.pop(request_id, None)

    def _buffer(self, request_id: str) -> tuple[ResidentBlockSet, torch.Tensor]:
        entry = self.buffers.get(request_id)
        if entry is None:
            _, block_size, width = self.tier_rows.shape
            entry = (ResidentBlockSet(self.capacity),
                     self.tier_rows.new_zeros(self.capacity, block_size, width))
            self.buffers[request_id] = entry
        return entry

    def gather_decode_rows(self, metadata: AttentionMetadata, selection: torch.Tensor) -> torch.Tensor:
        """The latent rows [num_decodes, width, row width] at the decodes' selected positions [num_decodes, width]
        (-1: none, zeros come back)."""
        num_decodes, width = selection.shape
        block_size, row_width = self.tier_rows.shape[1:]
        rows = self.tier_rows.new_zeros(num_decodes, width, row_width)
        block_table = metadata.block_table[:num_decodes].to(torch.long)
        request_ids = self.step.request_ids
        if not request_ids:
            # A forward outside the scheduler's steps (start-up chunk profiling): read straight from the tier.
            return gather_selected_rows(self.tier_rows, block_table, selection)
        if len(request_ids) < num_decodes:
            raise RuntimeError(f"sparse KV offload: the step has {num_decodes} decodes but begin_step named "
                               f"{len(request_ids)} requests")
        for row in range(num_decodes):
            block_set, buffer = self._buffer(request_ids[row])
            newest = metadata.seq_lens_cpu[row] - 1
            newest_block = int(block_table[row, newest // block_size])
            newest_slot = block_set.slot(newest_block)
            if newest_slot is not None:
                buffer[newest_slot, newest % block_size] = self.tier_rows[newest_block, newest % block_size]
            entries = (selection[row] >= 0).nonzero()[:, 0]
            if entries.numel() == 0:
                continue
            positions = selection[row, entries]
            block_ids = block_table[row, positions // block_size]
            unique_block_ids, block_of_entry = torch.unique(block_ids, return_inverse=True)
            plan = block_set.plan(unique_block_ids.tolist())
            self.stats.num_block_hits += plan.num_hits
            self.stats.num_block_misses += plan.num_misses
            self.stats.num_blocks_moved_in += plan.num_misses
            self.stats.num_blocks_evicted += plan.num_evictions
            self.stats.num_multi_round_gathers += len(plan.rounds) > 1
            offsets = positions % block_size
            # Each unique block's round and slot in that round, then per selected entry.
            round_and_slot = {block_id: (index, slot) for index, residency_round in enumerate(plan.rounds)
                              for block_id, slot in residency_round.resident.items()}
            block_rounds, block_slots = zip(*(round_and_slot[b] for b in unique_block_ids.tolist()))
            slot_of_entry = torch.tensor(block_slots, dtype=torch.long)[block_of_entry]
            if len(plan.rounds) == 1:
                self._load(buffer, plan.rounds[0].loads)
                rows[row, entries] = buffer[slot_of_entry, offsets]
                continue
            round_of_entry = torch.tensor(block_rounds, dtype=torch.long)[block_of_entry]
            for index, residency_round in enumerate(plan.rounds):
                self._load(buffer, residency_round.loads)
                in_round = (round_of_entry == index).nonzero()[:, 0]
                rows[row, entries[in_round]] = buffer[slot_of_entry[in_round], offsets[in_round]]
        return rows

    def _load(self, buffer: torch.Tensor, loads: list[tuple[int, int]]) -> None:
        """Copy the tier's blocks into the buffer's slots [(block id, slot)]."""
        if not loads:
            return
        block_ids = torch.tensor([block_id for block_id, _ in loads], dtype=torch.long)
        slots = torch.tensor([slot for _, slot in loads], dtype=torch.long)
        buffer.index_copy_(0, slots, self.tier_rows.index_select(0, block_ids))


__all__ = ["LayerResidentBuffers", "StepRequests"]
