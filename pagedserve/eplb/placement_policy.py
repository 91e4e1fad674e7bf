"""The EPLB policy interface and registry.

A policy maps one layer's load history to a placement: physical_to_logical [num_ranks * slots_per_rank],
where every logical expert has >= 1 replica and no rank holds two replicas of one expert. Policies are
deterministic (every EP rank computes the same placement from the same all-reduced loads).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class PlacementPolicy(ABC):
    name = "abstract"

    @abstractmethod
    def place(self, loads: np.ndarray, num_ranks: int, slots_per_rank: int,
              current: np.ndarray) -> np.ndarray:
        """loads [steps, num_experts] (tokens per step per logical expert); current placement [P] -> new [P]."""


def get_policy(name: str) -> PlacementPolicy:
    from pagedserve.eplb.default_policy import DefaultPolicy
    from pagedserve.eplb.flashlb_policy import FlashLBPolicy

    policies: dict[str, type[PlacementPolicy]] = {"default": DefaultPolicy, "flashlb": FlashLBPolicy}
    if name not in policies:
        raise ValueError(f"eplb policy={name!r} must be one of {sorted(policies)}")
    return policies[name]()


def check_capacity(num_experts: int, num_ranks: int, slots_per_rank: int) -> int:
    """The number of redundant slots; ValueError when the slots cannot hold every expert without duplicates."""
    num_slots = num_ranks * slots_per_rank
    redundant = num_slots - num_experts
    if redundant < 0 or redundant > num_experts * (num_ranks - 1) or slots_per_rank > num_experts:
        raise ValueError(f"{num_slots} slots on {num_ranks} ranks cannot hold {num_experts} experts with at least one "
                         f"replica each and no rank holding two copies of one expert")
    return redundant


def assign_replica_counts(weights: np.ndarray, num_redundant: int, max_replicas: int) -> np.ndarray:
    """Greedy min-max: each extra replica goes to the expert with the largest weight per replica (capped at
    `max_replicas`, the number of ranks). Ties break on the lower expert id (deterministic)."""
    counts = np.ones(weights.shape[0], dtype=np.int64)
    for _ in range(num_redundant):
        per_replica = np.where(counts < max_replicas, weights / counts, -np.inf)
        if not np.isfinite(per_replica).any():
            raise ValueError(f"{num_redundant} redundant replicas do not fit: every expert already has "
                             f"max_replicas={max_replicas}")
        counts[int(np.argmax(per_replica))] += 1
    return counts
