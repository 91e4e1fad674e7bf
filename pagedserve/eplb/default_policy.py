"""The 'default' policy (DeepSeek's EPLB, global form): replicate the heaviest experts, then pack the
replicas onto ranks largest-first, each to the least-loaded rank that still has a free slot and does not
already hold that expert."""
from __future__ import annotations

import numpy as np

from pagedserve.eplb.placement_policy import PlacementPolicy, assign_replica_counts, check_capacity


def pack_largest_first(replica_loads: list[tuple[float, int]], num_ranks: int, slots_per_rank: int) -> np.ndarray:
    """replica_loads: (load of one replica, logical expert) per replica -> physical_to_logical."""
    rank_load = np.zeros(num_ranks)
    rank_experts: list[list[int]] = [[] for _ in range(num_ranks)]
    for load, expert in sorted(replica_loads, key=lambda item: (-item[0], item[1])):
        candidates = [r for r in range(num_ranks) if len(rank_experts[r]) < slots_per_rank
                      and expert not in rank_experts[r]]
        rank = min(candidates, key=lambda r: (rank_load[r], r))
        rank_experts[rank].append(expert)
        rank_load[rank] += load
    return np.array([e for experts in rank_experts for e in experts], dtype=np.int64)


class DefaultPolicy(PlacementPolicy):
    name = "default"

    def place(self, loads: np.ndarray, num_ranks: int, slots_per_rank: int,
              current: np.ndarray) -> np.ndarray:
        total = loads.sum(axis=0).astype(np.float64)
        num_redundant = check_capacity(total.shape[0], num_ranks, slots_per_rank)
        counts = assign_replica_counts(total, num_redundant, num_ranks)
        replicas = [(total[e] / counts[e], e) for e in range(total.shape[0]) for _ in range(counts[e])]
        return pack_largest_first(replicas, num_ranks, slots_per_rank)
