"""Batch-invariant matrix products: every row is computed by a GEMM call of one fixed shape.

Why: the CPU GEMM libraries pick their kernel, blocking and reduction split from the problem shape.
MKL's float32 sgemm takes a GEMV-like path for M = 1 and other kernels for small M; oneDNN's bfloat16
kernels change above M = 32 (measured on this build: a row of `x @ W` differs in the last bits between
M = 1 and M = 2..6 in float32, and between M <= 32 and M > 32 in bfloat16). So the same token's
activations give different bits depending on how many other tokens share its GEMM.

How: rows are copied into a zero-padded buffer of whole tiles of ROW_TILE rows, and each tile is one
`mm` / `addmm` call of the same shape [ROW_TILE, K] x [K, N]. Within one fixed shape the result of a row
depends neither on its position in the tile nor on the other rows' values: checked bit for bit by
tests/batch_invariant/test_matmul.py. The results equal the plain product within rounding, not bitwise
(a different kernel may run). A loop of `mm` rather than one `bmm` over the tiles: in bfloat16 oneDNN's
batched product with a broadcast weight is 5-40x slower than the loop (measured, one thread).
`bmm` (3-D @ 3-D, not on the dense models' path) tiles each item's rows the same way in one `bmm`.

Invariance holds for a fixed intra-op thread count (the kernels' thread split is part of the shape).
"""
from __future__ import annotations

import torch

# Rows per GEMM call. A power of two at or below 32 keeps oneDNN's bfloat16 kernel and MKL's float32
# kernel of one family for every tile; 16 keeps the padding waste of a batch-1 decode low.
ROW_TILE = 16


def _num_tiles(num_rows: int) -> int:
    return -(-num_rows // ROW_TILE)


def _pad_rows(x: torch.Tensor, num_tiles: int) -> torch.Tensor:
    """x [..., M, K] -> a fresh contiguous [..., num_tiles * ROW_TILE, K] with zero rows after M.

    A fresh buffer also pins the operand's alignment (the allocator's), which MKL's results may depend on.
    """
    num_rows = x.shape[-2]
    padded = x.new_empty(*x.shape[:-2], num_tiles * ROW_TILE, x.shape[-1])
    padded[..., :num_rows, :].copy_(x)
    padded[..., num_rows:, :].zero_()
    return padded


def batch_invariant_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N], each row computed in a [ROW_TILE, K] x [K, N] GEMM."""
    num_rows, num_cols = a.shape[0], b.shape[1]
    if num_rows == 0:
        return a.new_empty(0, num_cols)
    padded = _pad_rows(a, _num_tiles(num_rows))
    output = a.new_empty(padded.shape[0], num_cols)
    for start in range(0, padded.shape[0], ROW_TILE):
        torch.mm(padded[start:start + ROW_TILE], b, out=output[start:start + ROW_TILE])
    return output[:num_rows]


def batch_invariant_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1,
                          alpha: float = 1) -> torch.Tensor:
    """beta * bias + alpha * (a @ b), bias broadcastable to [M, N], added inside each tile's GEMM (one
    rounding, like addmm)."""
    num_rows, num_cols = a.shape[0], b.shape[1]
    if num_rows == 0:
        return a.new_empty(0, num_cols)
    num_tiles = _num_tiles(num_rows)
    padded = _pad_rows(a, num_tiles)
    row_bias = bias.expand(num_rows, num_cols)
    if row_bias.stride(0) == 0:  # one bias row for every row: the same for every tile
        tile_bias = row_bias[:1].expand(num_tiles * ROW_TILE, num_cols)
    else:  # a bias per row: it travels with its row
        tile_bias = _pad_rows(row_bias, num_tiles)
    output = a.new_empty(padded.shape[0], num_cols)
    for start in range(0, padded.shape[0], ROW_TILE):
        end = start + ROW_TILE
        torch.addmm(tile_bias[start:end], padded[start:end], b, beta=beta, alpha=alpha, out=output[start:end])
    return output[:num_rows]


def batch_invariant_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] -> [B, M, N], each item's rows tiled like batch_invariant_mm."""
    batch, num_rows, depth = a.shape
    num_cols = b.shape[2]
    if batch == 0 or num_rows == 0:
        return a.new_empty(batch, num_rows, num_cols)
    num_tiles = _num_tiles(num_rows)
    tiles = _pad_rows(a, num_tiles).view(batch * num_tiles, ROW_TILE, depth)
    # Each item's matrix repeated for each of its tiles (a copy only when an item spans several tiles).
    tile_b = b[:, None].expand(batch, num_tiles, depth, num_cols).reshape(batch * num_tiles, depth, num_cols)
    output = torch.bmm(tiles, tile_b)
    return output.view(batch, num_tiles * ROW_TILE, num_cols)[:, :num_rows]


__all__ = ["ROW_TILE", "batch_invariant_addmm", "batch_invariant_bmm", "batch_invariant_mm"]
