"""Weight loader helpers shared by the parallel layers.

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)`; parameters that are not
sharded use `default_weight_loader`, which checks the shape and copies.
"""
from __future__ import annotations

import torch


def check_shape(param: torch.Tensor, loaded_weight: torch.Tensor, name: str = "weight") -> None:
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise ValueError(
            f"{name}: checkpoint tensor has shape {tuple(loaded_weight.shape)} but the parameter expects "
            f"{tuple(param.shape)}"
        )


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    """Copy a whole (unsharded) tensor into `param`, converting dtype and device."""
    if shard_id is not None:
        raise ValueError(f"shard_id={shard_id!r} given for an unsharded parameter")
    check_shape(param, loaded_weight)
    with torch.no_grad():
        param.copy_(loaded_weight)


def divide(numerator: int, denominator: int, what: str) -> int:
    """Exact division, with an error that says which size does not split evenly."""
    if numerator % denominator != 0:
        raise ValueError(f"{what}={numerator} is not divisible by tensor parallel size {denominator}")
    return numerator // denominator
