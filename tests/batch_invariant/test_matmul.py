"""The batch-invariant matmuls and the dispatch mode: a row's bits do not depend on the other rows."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pagedserve.batch_invariant.dispatch_mode import BatchInvariantMode
from pagedserve.batch_invariant.elementwise import vector_path_unary
from pagedserve.batch_invariant.matmul import (
    ROW_TILE,
    batch_invariant_addmm,
    batch_invariant_bmm,
    batch_invariant_mm,
)

# (K, N): the tiny test model's projections, SmolLM2's (576 hidden, 1536 MLP, 960 QKV) and its LM head.
SHAPES = [(64, 128), (64, 640), (576, 960), (576, 576), (1536, 576), (576, 49152)]
DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.bfloat16: dict(atol=0.2, rtol=2e-2)}


def _rows_with_target(target: torch.Tensor, num_rows: int, position: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(num_rows, target.shape[0], generator=generator).to(target.dtype)
    rows[position] = target
    return rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("depth, width", SHAPES)
def test_mm_row_identical_for_every_batch_size(depth: int, width: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    weight = torch.randn(width, depth).to(dtype)
    target = torch.randn(depth).to(dtype)
    expected = batch_invariant_mm(target[None], weight.t())[0]
    rng = random.Random(depth * width)
    # Every M up to 64 on the small shapes; on the big ones every M around the tile and kernel switches.
    row_counts = range(1, 65) if depth * width < 100_000 else [1, 2, 3, 5, 7, 15, 16, 17, 31, 32, 33, 48, 64]
    for num_rows in [*row_counts, ROW_TILE * 5 + 3, 200]:
        position = rng.randrange(num_rows)
        rows = _rows_with_target(target, num_rows, position, seed=num_rows)
        output = batch_invariant_mm(rows, weight.t())
        assert output.shape == (num_rows, width)
        assert torch.equal(output[position], expected), (num_rows, position)
        if num_rows in (1, 17, 64):
            torch.testing.assert_close(output, rows @ weight.t(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_addmm_with_a_bias_row_or_a_bias_per_row(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    depth, width = 576, 960
    weight, bias = torch.randn(width, depth).to(dtype), torch.randn(width).to(dtype)
    target = torch.randn(depth).to(dtype)
    expected = batch_invariant_addmm(bias, target[None], weight.t())[0]
    for num_rows in range(1, 50):
        position = num_rows // 2
        rows = _rows_with_target(target, num_rows, position, seed=num_rows)
        output = batch_invariant_addmm(bias, rows, weight.t())
        assert torch.equal(output[position], expected), num_rows
        per_row_bias = bias.expand(num_rows, width).clone()
        assert torch.equal(batch_invariant_addmm(per_row_bias, rows, weight.t())[position],
                           batch_invariant_addmm(per_row_bias[:1], target[None], weight.t())[0])
    torch.testing.assert_close(output, F.linear(rows, weight, bias), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_rows_identical_for_every_batch_and_row_count(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    first = torch.randn(3, 40, 64).to(dtype)
    second = torch.randn(3, 64, 96).to(dtype)
    expected = batch_invariant_bmm(first[1:2, 5:6], second[1:2])[0, 0]
    for num_rows in range(6, 41):
        for batch in (2, 3):
            output = batch_invariant_bmm(first[:batch, :num_rows], second[:batch])
            assert torch.equal(output[1, 5], expected), (batch, num_rows)
    torch.testing.assert_close(output, torch.bmm(first, second), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_mode_makes_linear_and_matmul_rows_invariant(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    weight, bias = torch.randn(576, 576).to(dtype), torch.randn(576).to(dtype)
    target = torch.randn(576).to(dtype)
    with torch.inference_mode(), BatchInvariantMode():
        expected_linear = F.linear(target[None], weight, bias)[0]
        expected_matmul = (target[None] @ weight)[0]
        for num_rows in (2, 7, 33, 48, 100):
            rows = _rows_with_target(target, num_rows, num_rows - 1, seed=num_rows)
            assert torch.equal(F.linear(rows, weight, bias)[-1], expected_linear)
            assert torch.equal((rows @ weight)[-1], expected_matmul)
            assert torch.equal(torch.mm(rows, weight)[-1], expected_matmul)
            assert torch.equal(F.linear(rows[None], weight, bias)[0, -1], expected_linear)  # 3-D input


def test_plain_float32_linear_depends_on_the_batch_on_this_build() -> None:
    """Why the mode exists: without it a row's float32 result changes with the number of rows."""
    torch.manual_seed(4)
    weight, target = torch.randn(1536, 576), torch.randn(576)
    alone = F.linear(target[None], weight)[0]
    in_batches = [F.linear(_rows_with_target(target, n, 0, seed=n), weight)[0] for n in range(2, 17)]
    assert any(not torch.equal(alone, row) for row in in_batches)


def test_mode_single_value_sum_reduced_like_a_row_of_a_batch() -> None:
    torch.manual_seed(5)
    row = torch.randn(49152)
    batch = torch.stack([row, torch.randn(49152)])
    with torch.inference_mode(), BatchInvariantMode():
        assert torch.equal(row[None].sum(dim=-1)[0], batch.sum(dim=-1)[0])
        assert torch.equal(row.sum(), batch.sum(dim=-1)[0])
        assert torch.equal(row[None].mean(dim=-1, keepdim=True)[0, 0], batch.mean(dim=-1)[0])


@pytest.mark.parametrize("function", [F.silu, torch.sigmoid, torch.exp])
def test_vector_path_elementwise_row_identical_for_every_batch_size(function) -> None:
    torch.manual_seed(6)
    target = torch.randn(100) * 4
    expected = vector_path_unary(function, target[None])[0]
    for num_rows in range(1, 400, 7):
        rows = torch.randn(num_rows, 100) * 4
        rows[-1] = target
        assert torch.equal(vector_path_unary(function, rows)[-1], expected), num_rows
        with torch.inference_mode(), BatchInvariantMode():
            assert torch.equal(function(rows)[-1], expected), num_rows
    torch.testing.assert_close(expected, function(target), atol=1e-6, rtol=1e-6)


def test_mode_refuses_ops_without_an_invariant_form() -> None:
    query = torch.randn(1, 2, 4, 8)
    with torch.inference_mode(), BatchInvariantMode():
        with pytest.raises(RuntimeError, match="batch_invariant=True has no batch-invariant form"):
            F.scaled_dot_product_attention(query, query, query)


def test_mode_refuses_prepacked_onednn_linears() -> None:
    """weight_layout='prepacked' computes with mkldnn ops the mode cannot tile: they must fail loudly
    (the config already resolves 'auto' to 'plain' and rejects 'prepacked' with batch_invariant=True)."""
    weight = torch.randn(32, 64)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    with torch.inference_mode(), BatchInvariantMode():
        with pytest.raises(RuntimeError, match="mkldnn::_linear_pointwise"):
            torch.ops.mkldnn._linear_pointwise(torch.randn(4, 64), packed, None, "none", [], "")
