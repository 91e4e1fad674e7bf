"""Data-parallel coordination: which engine core (DP rank) gets each new request, and when none may.

Pure policy over per-rank load snapshots, unit-testable with fabricated loads:

- Routing: the least-loaded admissible rank, by (waiting + running requests, KV blocks in use, rank).
- Balance scheduling (enable_balance_scheduling, vllm-ascend's global gate): while any rank runs
  max_num_seqs requests, no rank is given new requests.
- Bubble gate (dyntra_lb_config.enabled, the admission part of DyntraLB): a rank whose KV load exceeds
  the mean by more than bubble_threshold is not given new requests; a threshold >= 1 counts KV blocks
  (load - mean > threshold), a threshold < 1 is a ratio ((load - mean) / max load > threshold).

A request no rank may take waits in the coordinator (FIFO) and is routed at a later step.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.config.parallel import DyntraLBConfig


@dataclass(frozen=True)
class RankLoad:
    """One DP rank's load at a moment."""

    num_waiting: int
    num_running: int
    num_kv_blocks_used: int


def exceeds_bubble(loads: list[RankLoad], rank: int, bubble_threshold: float) -> bool:
    """Whether `rank`'s KV load is above the mean by more than the threshold (blocks or ratio)."""
    used = [load.num_kv_blocks_used for load in loads]
    mean = sum(used) / len(used)
    excess = used[rank] - mean
    if bubble_threshold >= 1:
        return excess > bubble_threshold
    peak = max(used)
    return peak > 0 and excess / peak > bubble_threshold


class DPCoordinator:
    def __init__(self, num_ranks: int, max_num_seqs: int, enable_balance_scheduling: bool = False,
                 dyntra_lb_config: DyntraLBConfig | None = None) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks={num_ranks} must be >= 1")
        self.num_ranks = num_ranks
        self.max_num_seqs = max_num_seqs
        self.enable_balance_scheduling = enable_balance_scheduling
        self.dyntra_lb_config = dyntra_lb_config or DyntraLBConfig()

    def admissible_ranks(self, loads: list[RankLoad]) -> list[int]:
        """The ranks that may be given a new request now (possibly none)."""
        if len(loads) != self.num_ranks:
            raise ValueError(f"got {len(loads)} loads for {self.num_ranks} DP ranks")
        if self.enable_balance_scheduling and any(load.num_running >= self.max_num_seqs for load in loads):
            return []
        ranks = list(range(self.num_ranks))
        if self.dyntra_lb_config.enabled:
            threshold = self.dyntra_lb_config.bubble_threshold
            ranks = [rank for rank in ranks if not exceeds_bubble(loads, rank, threshold)]
        return ranks

    def choose_rank(self, loads: list[RankLoad]) -> int | None:
        """The least-loaded admissible rank, or None when the request must wait."""
        ranks = self.admissible_ranks(loads)
        if not ranks:
            return None
        return min(ranks, key=lambda rank: (loads[rank].num_waiting + loads[rank].num_running,
                                            loads[rank].num_kv_blocks_used, rank))
