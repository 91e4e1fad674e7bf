"""Parallel linear layers: shard math of every weight_loader, with tensor parallelism simulated by
building each rank's shard in one process (tp_rank/tp_size given explicitly)."""
from __future__ import annotations

import pytest
import torch

from pagedserve.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                      ReplicatedLinear, RowParallelLinear)

HIDDEN = 24
HEAD_DIM = 4


def _random(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("num_heads,num_kv_heads,tp_size", [
    (4, 2, 1), (4, 2, 2), (4, 2, 4), (8, 1, 4), (4, 4, 2), (6, 2, 2),
])
def test_qkv_shards_hold_the_right_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    q_weight = _random(num_heads * HEAD_DIM, HIDDEN, seed=1)
    k_weight = _random(num_kv_heads * HEAD_DIM, HIDDEN, seed=2)
    v_weight = _random(num_kv_heads * HEAD_DIM, HIDDEN, seed=3)
    q_bias, k_bias, v_bias = _random(num_heads * HEAD_DIM, seed=4), _random(num_kv_heads * HEAD_DIM, seed=5), \
        _random(num_kv_heads * HEAD_DIM, seed=6)
    x = _random(3, HIDDEN, seed=7)
    full_q = (x @ q_weight.T + q_bias).view(3, num_heads, HEAD_DIM)
    full_k = (x @ k_weight.T + k_bias).view(3, num_kv_heads, HEAD_DIM)
    full_v = (x @ v_weight.T + v_bias).view(3, num_kv_heads, HEAD_DIM)
    replicas = max(tp_size // num_kv_heads, 1)
    for rank in range(tp_size):
        layer = QKVParallelLinear(HIDDEN, HEAD_DIM, num_heads, num_kv_heads, bias=True, tp_rank=rank,
                                  tp_size=tp_size)
        assert layer.num_heads == num_heads // tp_size
        assert layer.num_kv_heads == max(num_kv_heads // tp_size, 1)
        assert layer.num_kv_head_replicas == replicas
        for shard_id, weight, bias in (("q", q_weight, q_bias), ("k", k_weight, k_bias), ("v", v_weight, v_bias)):
            layer.weight.weight_loader(layer.weight, weight, shard_id)
            layer.bias.weight_loader(layer.bias, bias, shard_id)
        q, k, v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        heads = slice(rank * layer.num_heads, (rank + 1) * layer.num_heads)
        first_kv = (rank // replicas) * layer.num_kv_heads
        kv_heads = slice(first_kv, first_kv + layer.num_kv_heads)
        torch.testing.assert_close(q.view(3, -1, HEAD_DIM), full_q[:, heads])
        torch.testing.assert_close(k.view(3, -1, HEAD_DIM), full_k[:, kv_heads])
        torch.testing.assert_close(v.view(3, -1, HEAD_DIM), full_v[:, kv_heads])


def test_qkv_loads_an_already_fused_checkpoint_tensor() -> None:
    num_heads, num_kv_heads = 4, 2
    fused = _random((num_heads + 2 * num_kv_heads) * HEAD_DIM, HIDDEN)
    layer = QKVParallelLinear(HIDDEN, HEAD_DIM, num_heads, num_kv_heads, bias=False, tp_rank=0, tp_size=1)
    layer.weight.weight_loader(layer.weight, fused)
    torch.testing.assert_close(layer.weight.data, fused)


def test_qkv_rejects_bad_shard_and_shape() -> None:
    layer = QKVParallelLinear(HIDDEN, HEAD_DIM, 4, 2, bias=False, tp_rank=0, tp_size=1)
    with pytest.raises(ValueError, match="shard_id='x'"):
        layer.weight.weight_loader(layer.weight, _random(8, HIDDEN), "x")
    with pytest.raises(ValueError, match="has 7 rows, expected 8"):
        layer.weight.weight_loader(layer.weight, _random(7, HIDDEN), "k")
    with pytest.raises(ValueError, match="total_num_heads=4 is not divisible by tensor parallel size 3"):
        QKVParallelLinear(HIDDEN, HEAD_DIM, 4, 2, tp_rank=0, tp_size=3)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_merged_column_matches_separate_projections(tp_size: int) -> None:
    gate, up = _random(16, HIDDEN, seed=1), _random(16, HIDDEN, seed=2)
    x = _random(5, HIDDEN, seed=3)
    gate_out, up_out = x @ gate.T, x @ up.T
    shard = 16 // tp_size
    for rank in range(tp_size):
        layer = MergedColumnParallelLinear(HIDDEN, [16, 16], bias=False, tp_rank=rank, tp_size=tp_size)
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        local_gate, local_up = layer(x).split(shard, dim=-1)
        torch.testing.assert_close(local_gate, gate_out[:, rank * shard:(rank + 1) * shard])
        torch.testing.assert_close(local_up, up_out[:, rank * shard:(rank + 1) * shard])


@pytest.mark.parametrize("tp_size", [1, 2, 3])
def test_column_then_row_parallel_sum_to_the_full_product(tp_size: int) -> None:
    up_weight, up_bias = _random(12, HIDDEN, seed=1), _random(12, seed=2)
    down_weight, down_bias = _random(HIDDEN, 12, seed=3), _random(HIDDEN, seed=4)
    x = _random(4, HIDDEN, seed=5)
    expected = (x @ up_weight.T + up_bias) @ down_weight.T + down_bias
    partial_sums = torch.zeros_like(expected)
    gathered = []
    for rank in range(tp_size):
        column = ColumnParallelLinear(HIDDEN, 12, bias=True, tp_rank=rank, tp_size=tp_size)
        column.weight.weight_loader(column.weight, up_weight)
        column.bias.weight_loader(column.bias, up_bias)
        row = RowParallelLinear(12, HIDDEN, bias=True, tp_rank=rank, tp_size=tp_size)
        row.weight.weight_loader(row.weight, down_weight)
        row.bias.weight_loader(row.bias, down_bias)
        hidden = column(x)
        gathered.append(hidden)
        # One process stands for all ranks: the all-reduce is the identity here, so sum by hand.
        partial_sums += row(hidden)
    torch.testing.assert_close(torch.cat(gathered, dim=-1), x @ up_weight.T + up_bias)
    torch.testing.assert_close(partial_sums, expected, atol=1e-5, rtol=1e-5)


def test_row_parallel_splits_a_full_input_when_asked() -> None:
    weight = _random(HIDDEN, 12)
    x = _random(2, 12, seed=1)
    total = torch.zeros(2, HIDDEN)
    for rank in range(2):
        row = RowParallelLinear(12, HIDDEN, bias=False, input_is_parallel=False, tp_rank=rank, tp_size=2)
        row.weight.weight_loader(row.weight, weight)
        total += row(x)
    torch.testing.assert_close(total, x @ weight.T, atol=1e-5, rtol=1e-5)


def test_replicated_linear_and_shape_errors() -> None:
    layer = ReplicatedLinear(HIDDEN, 8, bias=False, prefix="head")
    weight = _random(8, HIDDEN)
    layer.weight.weight_loader(layer.weight, weight)
    torch.testing.assert_close(layer(torch.eye(HIDDEN)), weight.T)
    with pytest.raises(ValueError, match=r"head: checkpoint tensor has shape \(8, 23\)"):
        layer.weight.weight_loader(layer.weight, _random(8, HIDDEN - 1))
    column = ColumnParallelLinear(HIDDEN, 8, tp_rank=0, tp_size=2, prefix="up")
    with pytest.raises(ValueError, match="up: checkpoint tensor has 6 output rows, expected 8"):
        column.weight.weight_loader(column.weight, _random(6, HIDDEN))
    with pytest.raises(ValueError, match="tp_rank=2 must be an integer in"):
        ColumnParallelLinear(HIDDEN, 8, tp_rank=2, tp_size=2)
