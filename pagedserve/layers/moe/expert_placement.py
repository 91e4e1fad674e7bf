"""Physical placement of logical experts: slots, replicas and the logical -> physical replica map.

There are `num_physical = num_logical + num_redundant` expert slots, `num_physical / ep_size` per rank;
physical id p lives on rank p // slots_per_rank at local slot p % slots_per_rank. A placement is the
vector physical_to_logical[p]. Every logical expert has at least one replica; EPLB adds replicas of hot
experts in the redundant slots and moves experts between ranks.
"""
from __future__ import annotations

import torch


def identity_placement(num_logical: int, num_redundant: int, ep_size: int) -> torch.Tensor:
    """Logical 0..E-1 in order, then redundant copies of experts 0..R-1 (as vllm-ascend's initial layout).

    Raises ValueError when the slots do not split evenly over the ranks, or when a rank would have to hold
    two copies of one expert (more than E * (ep_size - 1) redundant slots cannot avoid that).
    """
    num_physical = num_logical + num_redundant
    if num_redundant < 0:
        raise ValueError(f"num_redundant_experts={num_redundant} must be >= 0")
    if num_physical % ep_size != 0:
        raise ValueError(f"num_experts + num_redundant_experts = {num_physical} must be divisible by the expert "
                         f"parallel size {ep_size}")
    if num_redundant > num_logical * (ep_size - 1):
        raise ValueError(f"num_redundant_experts={num_redundant} must be <= num_experts * (ep_size - 1) = "
                         f"{num_logical * (ep_size - 1)}: no rank may hold two copies of one expert")
    placement = torch.cat([torch.arange(num_logical), torch.arange(num_redundant) % num_logical])
    validate_placement(placement, num_logical, ep_size)
    return placement


def validate_placement(physical_to_logical: torch.Tensor, num_logical: int, ep_size: int) -> None:
    """Every logical expert placed at least once, ids in range, no expert twice on one rank."""
    placement = physical_to_logical.reshape(ep_size, -1)
    if int(physical_to_logical.min()) < 0 or int(physical_to_logical.max()) >= num_logical:
        raise ValueError(f"placement ids must be in [0, {num_logical - 1}]")
    counts = torch.bincount(physical_to_logical, minlength=num_logical)
    if bool((counts == 0).any()):
        missing = torch.nonzero(counts == 0).flatten().tolist()
        raise ValueError(f"placement leaves logical experts {missing} without a replica")
    for rank in range(ep_size):
        row = placement[rank]
        if row.unique().numel() != row.numel():
            raise ValueError(f"placement puts two copies of one expert on rank {rank}: {row.tolist()}")


def replica_map(physical_to_logical: torch.Tensor, num_logical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logical_to_physical [E, max_replicas] padded with -1, replica_counts [E])."""
    counts = torch.bincount(physical_to_logical, minlength=num_logical)
    max_replicas = int(counts.max())
    table = torch.full((num_logical, max_replicas), -1, dtype=torch.long)
    # Stable sort by logical id: replicas of one expert in increasing physical order.
    order = torch.argsort(physical_to_logical, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    sorted_logical = physical_to_logical[order]
    replica_index = torch.arange(order.numel()) - starts[sorted_logical]
    table[sorted_logical, replica_index] = order
    return table, counts


def rank_loads(logical_load: torch.Tensor, physical_to_logical: torch.Tensor, ep_size: int) -> torch.Tensor:
    """Tokens each rank computes when every expert's tokens spread evenly over its replicas: [ep_size]."""
    counts = torch.bincount(physical_to_logical, minlength=logical_load.numel()).to(torch.float64)
    per_replica = logical_load.to(torch.float64)[physical_to_logical] / counts[physical_to_logical]
    return per_replica.reshape(ep_size, -1).sum(dim=1)


def imbalance(logical_load: torch.Tensor, physical_to_logical: torch.Tensor, ep_size: int) -> float:
    """max / mean tokens per rank (1.0 is perfect; 1.0 as well when there is no load)."""
    loads = rank_loads(logical_load, physical_to_logical, ep_size)
    mean = float(loads.mean())
    return float(loads.max()) / mean if mean > 0 else 1.0
