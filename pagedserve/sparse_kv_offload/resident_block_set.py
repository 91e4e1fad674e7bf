"""ResidentBlockSet: which KV blocks one request's resident buffer (of one layer) holds, and the LRU order in
which they are replaced (vllm-ascend's per-row residency over top-k selections, at block granularity).

Pure bookkeeping: the caller copies the blocks and gathers the rows the plan names. A step's plan lists rounds:
the first holds the needed blocks already resident (hits) and the misses that fit without evicting them; when the
needed blocks outnumber the buffer's slots, later rounds each load up to `capacity` more, evicting blocks the
step gathered in earlier rounds. The caller gathers each round's rows before loading the next round, so every
selected row is read from the buffer while its block is resident.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class ResidencyRound:
    """Blocks to read from the buffer in one round: `resident` {block id: slot} and `loads` [(block id, slot)]
    to copy in first."""

    resident: dict[int, int] = field(default_factory=dict)
    loads: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class ResidencyPlan:
    rounds: list[ResidencyRound]
    num_hits: int
    num_misses: int
    num_evictions: int


class ResidentBlockSet:
    """Up to `capacity` blocks in slots 0..capacity-1, least recently used first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1")
        self.capacity = capacity
        # block id -> slot, least recently used first.
        self.slot_of_block: OrderedDict[int, int] = OrderedDict()
        self._free_slots = list(range(capacity - 1, -1, -1))  # popped from the end: slot 0 first

    def __len__(self) -> int:
        return len(self.slot_of_block)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.slot_of_block

    def slot(self, block_id: int) -> int | None:
        return self.slot_of_block.get(block_id)

    def plan(self, block_ids: list[int]) -> ResidencyPlan:
        """Make every block of `block_ids` (distinct) resident, round by round (module docstring); hits become the
        most recently used, then the loads in order."""
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block_ids must be distinct, got {block_ids}")
        hits = [block_id for block_id in block_ids if block_id in self.slot_of_block]
        misses = [block_id for block_id in block_ids if block_id not in self.slot_of_block]
        for block_id in hits:
            self.slot_of_block.move_to_end(block_id)
        current = ResidencyRound(resident={block_id: self.slot_of_block[block_id] for block_id in hits})
        rounds = [current]
        # Blocks the current round reads: they sit at the recent end of the order, so the least recent entry is
        # evictable unless every entry is pinned.
        pinned = set(hits)
        num_evictions = 0
        for block_id in misses:
            slot, is_eviction = self._take_slot(pinned)
            if slot is None:
                current = ResidencyRound()
                rounds.append(current)
                pinned = set()
                slot, is_eviction = self._take_slot(pinned)
                assert slot is not None
            num_evictions += is_eviction
            self.slot_of_block[block_id] = slot
            current.loads.append((block_id, slot))
            current.resident[block_id] = slot
            pinned.add(block_id)
        return ResidencyPlan(rounds=rounds, num_hits=len(hits), num_misses=len(misses), num_evictions=num_evictions)

    def _take_slot(self, pinned: set[int]) -> tuple[int | None, bool]:
        """A free slot, else the least recently used unpinned block's (evicted); (None, False) when all are
        pinned."""
        if self._free_slots:
            return self._free_slots.pop(), False
        oldest = next(iter(self.slot_of_block))
        if oldest in pinned:
            return None, False
        return self.slot_of_block.pop(oldest), True


__all__ = ["ResidencyPlan", "ResidencyRound", "ResidentBlockSet"]
