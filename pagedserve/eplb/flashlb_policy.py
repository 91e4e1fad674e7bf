"""FlashLB: placement that balances the *risk* of each rank's load, not just its mean.

From the window of per-step loads X[t, e] (downsampled to at most SAMPLE_SIZE rows by summing consecutive
steps, +1 smoothing):
1. statistics: mu_e = mean, var_e = variance (ddof 1), cov = covariance of the experts' loads;
2. replica counts: every expert starts with one replica; each redundant slot goes to the expert with the
   largest (mu_e + z sigma_e) / replicas_e, z = Phi^-1(0.75) ~ 0.674 (never more replicas than ranks);
3. largest-first placement: replicas sorted by mu_e / replicas_e descending; each goes to the rank, among
   those with a free slot and not yet holding that expert, whose risk mu_d + z sqrt(var_d) after adding it
   is smallest, with mu_d += mu_e / r_e and var_d += var_e / r_e^2 + sum_{e' on d} 2 cov(e, e') / (r_e r_e');
   correlated hot experts therefore repel each other;
4. minimal movement: new rank rows are matched to old ones (Hungarian assignment maximising the experts that
   stay), and within a matched rank experts that stay keep their old slot.
Score (lower is better, 1 is perfect): mean over steps of max_d load[t, d] / mean_d load[t, d].
"""
from __future__ import annotations

import numpy as np

from pagedserve.eplb.placement_policy import PlacementPolicy, assign_replica_counts, check_capacity

Z_SCORE = 0.6744897501960817  # Phi^-1(0.75)
SAMPLE_SIZE = 64


def downsample(loads: np.ndarray, sample_size: int = SAMPLE_SIZE) -> np.ndarray:
    """Sum consecutive windows of steps so at most `sample_size` rows remain; +1 smoothing."""
    loads = loads.astype(np.float64)
    steps = loads.shape[0]
    if steps > sample_size:
        length = steps // sample_size
        loads = loads[steps - length * sample_size:].reshape(sample_size, length, -1).sum(axis=1)
    return loads + 1.0


def placement_score(loads: np.ndarray, placement: np.ndarray, num_ranks: int) -> float:
    """mean_t max_d / mean_d of the per-rank loads (replicas share their expert's load evenly)."""
    counts = np.bincount(placement, minlength=loads.shape[1])
    per_slot = loads[:, placement] / counts[placement]
    rank_loads = per_slot.reshape(loads.shape[0], num_ranks, -1).sum(axis=2)
    return float(np.mean(rank_loads.max(axis=1) / np.maximum(rank_loads.mean(axis=1), 1e-12)))


def risk_aware_placement(mu: np.ndarray, var: np.ndarray, cov: np.ndarray, counts: np.ndarray,
                         num_ranks: int, slots_per_rank: int) -> np.ndarray:
    order = sorted(((mu[e] / counts[e], e) for e in range(mu.shape[0]) for _ in range(counts[e])),
                   key=lambda item: (-item[0], item[1]))
    rank_mu = np.zeros(num_ranks)
    rank_var = np.zeros(num_ranks)
    rank_experts: list[list[int]] = [[] for _ in range(num_ranks)]
    for _, expert in order:
        share = 1.0 / counts[expert]
        best_rank, best_risk = -1, np.inf
        for rank in range(num_ranks):
            held = rank_experts[rank]
            if len(held) >= slots_per_rank or expert in held:
                continue
            covariance = sum(2.0 * cov[expert, other] * share / counts[other] for other in held)
            new_var = max(rank_var[rank] + var[expert] * share * share + covariance, 0.0)
            risk = rank_mu[rank] + mu[expert] * share + Z_SCORE * np.sqrt(new_var)
            if risk < best_risk:
                best_rank, best_risk, best_var = rank, risk, new_var
        if best_rank < 0:
            raise ValueError(f"no rank can take a replica of expert {expert} (slots full or already held)")
        rank_experts[best_rank].append(expert)
        rank_mu[best_rank] += mu[expert] * share
        rank_var[best_rank] = best_var
    return np.array([e for experts in rank_experts for e in experts], dtype=np.int64)


def keep_experts_in_place(new: np.ndarray, current: np.ndarray, num_ranks: int) -> np.ndarray:
    """Reorder the new placement's rank rows and slots to move as few experts as possible."""
    from scipy.optimize import linear_sum_assignment

    new_rows = new.reshape(num_ranks, -1)
    old_rows = current.reshape(num_ranks, -1)
    overlap = np.array([[len(set(new_rows[i]) & set(old_rows[j])) for j in range(num_ranks)]
                        for i in range(num_ranks)])
    new_index, old_index = linear_sum_assignment(-overlap)
    result = np.empty_like(old_rows)
    for i, j in zip(new_index, old_index):
        staying = set(new_rows[i]) & set(old_rows[j])
        incoming = [e for e in new_rows[i] if e not in staying]
        row = [e if e in staying else -1 for e in old_rows[j]]
        for slot, expert in enumerate(row):
            if expert == -1:
                row[slot] = incoming.pop(0)
        result[j] = row
    return result.reshape(-1)


class FlashLBPolicy(PlacementPolicy):
    name = "flashlb"

    def place(self, loads: np.ndarray, num_ranks: int, slots_per_rank: int,
              current: np.ndarray) -> np.ndarray:
        samples = downsample(loads)
        num_experts = samples.shape[1]
        num_redundant = check_capacity(num_experts, num_ranks, slots_per_rank)
        mu = samples.mean(axis=0)
        if samples.shape[0] > 1:
            var = samples.var(axis=0, ddof=1)
            cov = np.cov(samples, rowvar=False, ddof=1)
        else:
            var, cov = np.zeros(num_experts), np.zeros((num_experts, num_experts))
        counts = assign_replica_counts(mu + Z_SCORE * np.sqrt(var), num_redundant, num_ranks)
        placement = risk_aware_placement(mu, var, cov, counts, num_ranks, slots_per_rank)
        if current.shape == placement.shape:
            placement = keep_experts_in_place(placement, current, num_ranks)
            # Movement never makes it worse than staying put: keep the current placement if it scores better.
            if placement_score(samples, current, num_ranks) <= placement_score(samples, placement, num_ranks):
                return current.copy()
        return placement
