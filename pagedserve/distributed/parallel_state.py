"""Tensor-parallel state and collectives.

Today the engine runs with a single rank; the functions below already have the shape the layers need
so that multi-rank support (torch.distributed groups, gloo on CPU, nccl on CUDA) plugs in here without
touching layers or models. With a world size of 1 every collective is the identity.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed


@dataclass
class TensorParallelGroup:
    """One tensor-parallel group: this process's rank in it, its size and the torch process group."""

    rank: int = 0
    world_size: int = 1
    process_group: "torch.distributed.ProcessGroup | None" = None


_tensor_parallel_group = TensorParallelGroup()


def initialize_tensor_model_parallel(rank: int, world_size: int,
                                     process_group: "torch.distributed.ProcessGroup | None" = None) -> None:
    """Set this process's tensor-parallel rank and size (called by the worker at start-up)."""
    global _tensor_parallel_group
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor parallel world_size={world_size!r} must be an integer >= 1")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"tensor parallel rank={rank!r} must be an integer in [0, {world_size - 1}]")
    if world_size > 1 and process_group is None:
        raise ValueError(f"tensor parallel world_size={world_size} needs a torch.distributed process group")
    _tensor_parallel_group = TensorParallelGroup(rank=rank, world_size=world_size, process_group=process_group)


def destroy_tensor_model_parallel() -> None:
    """Return to the single-rank state."""
    global _tensor_parallel_group
    _tensor_parallel_group = TensorParallelGroup()


def get_tensor_model_parallel_world_size() -> int:
    return _tensor_parallel_group.world_size


def get_tensor_model_parallel_rank() -> int:
    return _tensor_parallel_group.rank


def resolve_tensor_parallel(tp_rank: int | None, tp_size: int | None) -> tuple[int, int]:
    """(rank, size) for a layer: explicit values win (tests simulate ranks that way), else this process's."""
    size = _tensor_parallel_group.world_size if tp_size is None else tp_size
    rank = _tensor_parallel_group.rank if tp_rank is None else tp_rank
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tp_size={size!r} must be an integer >= 1")
    if not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"tp_rank={rank!r} must be an integer in [0, {size - 1}]")
    return rank, size


def tensor_model_parallel_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over the tensor-parallel ranks (identity on one rank)."""
    group = _tensor_parallel_group
    if group.world_size == 1:
        return tensor
    torch.distributed.all_reduce(tensor, group=group.process_group)
    return tensor


def tensor_model_parallel_all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's `tensor` along `dim` in rank order (identity on one rank)."""
    group = _tensor_parallel_group
    if group.world_size == 1:
        return tensor
    dim = dim % tensor.dim()
    gathered = [torch.empty_like(tensor) for _ in range(group.world_size)]
    torch.distributed.all_gather(gathered, tensor.contiguous(), group=group.process_group)
    return torch.cat(gathered, dim=dim)
