"""The normalized Sylvester Hadamard rotation the C8 indexer cache applies to index keys and queries.

H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]; H_n / sqrt(n) is symmetric and orthogonal, so rotating both sides of a
dot product leaves it unchanged: (q H)(k H)^T = q k^T. What the rotation buys is spread: it mixes every channel
into every other, so one large channel no longer sets a whole row's int8 scale (DeepSeek-V3.2's indexer keys have a
rope part and a LayerNorm'ed part of unrelated magnitudes).
"""
from __future__ import annotations

from functools import lru_cache

import torch


def is_power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


@lru_cache(maxsize=8)
def _hadamard(dim: int, device: torch.device) -> torch.Tensor:
    matrix = torch.ones(1, 1, dtype=torch.float32)
    while matrix.shape[0] < dim:
        matrix = torch.cat([torch.cat([matrix, matrix], dim=1), torch.cat([matrix, -matrix], dim=1)], dim=0)
    return (matrix / dim ** 0.5).to(device)


def hadamard_matrix(dim: int, device: torch.device | str = "cpu", *, field: str = "index_head_dim") -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix [dim, dim] (float32; symmetric, orthogonal). ValueError naming
    `field` when dim is no power of two (Sylvester's construction has no other sizes)."""
    if not is_power_of_two(dim):
        raise ValueError(f"{field}={dim} must be a power of two for the Hadamard rotation of the int8 indexer cache "
                         f"(kv_cache_dtype='int8'); use kv_cache_dtype='auto' for this model")
    return _hadamard(dim, torch.device(device))


def rotate(rows: torch.Tensor) -> torch.Tensor:
    """rows [..., dim] times the normalized Hadamard matrix, in float32."""
    return rows.float() @ hadamard_matrix(rows.shape[-1], rows.device)


__all__ = ["hadamard_matrix", "is_power_of_two", "rotate"]
