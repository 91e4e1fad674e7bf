"""Decode context parallel, in one process: partial attention over each rank's positions merged by log-sum-exp
equals attention over all of them; the slots a rank writes read back, through the block table, as its positions
in order. (The engine over two gloo ranks: tests/distributed/test_decode_context_parallel_engine.py.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedserve.attention.decode_context_parallel import (
    DecodeContextParallel,
    merge_partial_attention,
    partial_attention,
)
from pagedserve.attention.torch_paged import gather_context
from pagedserve.distributed.parallel_state import GroupCoordinator


def _reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_positions: torch.Tensor,
               scale: float, sliding_window: int | None) -> torch.Tensor:
    key_positions = torch.arange(key.shape[1])
    visible = key_positions[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        visible &= key_positions[None, :] > query_positions[:, None] - sliding_window
    out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], key[None], value[None], attn_mask=visible,
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("num_ranks", [1, 2, 3])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_partials_over_split_positions_merge_to_full_attention(num_ranks: int, sliding_window: int | None) -> None:
    generator = torch.Generator().manual_seed(num_ranks)
    num_heads, num_kv_heads, dim, seq_len, q_len = 4, 2, 8, 23, 6
    query = torch.randn(q_len, num_heads, dim, generator=generator)
    key = torch.randn(num_kv_heads, seq_len, dim, generator=generator)
    value = torch.randn(num_kv_heads, seq_len, dim, generator=generator)
    query_positions = torch.arange(seq_len - q_len, seq_len)
    outputs, lses = [], []
    for rank in range(num_ranks):
        positions = torch.arange(rank, seq_len, num_ranks)
        out, lse = partial_attention(query, key[:, positions], value[:, positions], query_positions, positions,
                                     0.3, sliding_window)
        outputs.append(out)
        lses.append(lse)
    merged = merge_partial_attention(torch.stack(outputs), torch.stack(lses))
    expected = _reference(query, key, value, query_positions, 0.3, sliding_window)
    torch.testing.assert_close(merged, expected, rtol=1e-5, atol=1e-6)


def test_a_rank_that_sees_no_position_contributes_nothing() -> None:
    """Position 0's query sees only rank 0's position 0: rank 1's partial is empty (lse -inf, zero output)."""
    query = torch.randn(1, 2, 4)
    key, value = torch.randn(1, 3, 4), torch.randn(1, 3, 4)
    out1, lse1 = partial_attention(query, key[:, 1:2], value[:, 1:2], torch.tensor([0]), torch.tensor([1]), 1.0)
    assert torch.isneginf(lse1).all() and (out1 == 0).all()
    out0, lse0 = partial_attention(query, key[:, :1], value[:, :1], torch.tensor([0]), torch.tensor([0]), 1.0)
    merged = merge_partial_attention(torch.stack([out0, out1]), torch.stack([lse0, lse1]))
    torch.testing.assert_close(merged, value[0, 0].expand(1, 2, 4))


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_each_rank_reads_back_its_positions_in_order(num_ranks: int) -> None:
    """Write every position's number through each rank's local slots; the rank's context read through the block
    table (as attention reads it) is positions rank, rank + size, ... and every position lives on one rank."""
    page_block_size, seq_len = 4, 37
    tokens_per_block = page_block_size * num_ranks
    block_table = np.array([[5, 2, 7, 1, 3]], dtype=np.int32)  # a request's block ids, in position order
    positions = np.arange(seq_len)
    block_ids = block_table[0, positions // tokens_per_block]
    stored = 0
    for rank in range(num_ranks):
        group = GroupCoordinator(name="dcp", rank=rank, world_size=num_ranks, ranks=list(range(num_ranks)))
        dcp = DecodeContextParallel(group, page_block_size)
        slots, step = dcp.local_slots(block_ids, positions, torch.device("cpu"))
        assert len(set(slots.tolist())) == len(slots)
        kv_cache = torch.full((2, 8, page_block_size, 1, 1), -1.0)
        token_indices = step.local_token_indices
        values = torch.from_numpy(positions).float()[token_indices].view(-1, 1, 1)
        kv_cache.view(2, -1, 1, 1)[0].index_copy_(0, torch.from_numpy(slots), values)
        num_local = step.num_local_positions(seq_len)
        keys, _ = gather_context(kv_cache, torch.from_numpy(block_table[0]), num_local)
        assert keys.flatten().tolist() == list(range(rank, seq_len, num_ranks))
        assert step.local_key_positions(num_local, torch.device("cpu")).tolist() == list(range(rank, seq_len,
                                                                                              num_ranks))
        stored += num_local
    assert stored == seq_len


@pytest.mark.parametrize("score_chunk_bytes", [64 << 20, 2048])
def test_backend_on_a_group_of_one_equals_the_reference_backend(monkeypatch, score_chunk_bytes: int) -> None:
    """The backend's whole path (local writes, partials per request in query-row groups, merge) on a one-rank
    group equals torch_paged's reference for a decode, a prefill chunk behind a cached prefix and a fresh prefill;
    a tiny score budget forces one query row per group."""
    from paged_inputs import build_attention_metadata

    from pagedserve.attention import decode_context_parallel
    from pagedserve.attention.decode_context_parallel import DecodeContextParallelBackend
    from pagedserve.attention.torch_paged import reference_paged_attention

    monkeypatch.setattr(decode_context_parallel, "SCORE_CHUNK_BYTES", score_chunk_bytes)
    generator = torch.Generator().manual_seed(7)
    block_size, num_heads, num_kv_heads, dim = 4, 4, 2, 8
    block_tables = [[3, 1], [2, 5, 6], [4, 7]]
    num_new, num_computed = [1, 5, 6], [5, 4, 0]
    metadata, positions = build_attention_metadata(num_new, num_computed, block_tables, block_size)
    num_tokens = sum(num_new)
    query = torch.randn(num_tokens, num_heads, dim, generator=generator)
    key = torch.randn(num_tokens, num_kv_heads, dim, generator=generator)
    value = torch.randn(num_tokens, num_kv_heads, dim, generator=generator)
    prefix = torch.randn(2, 8, block_size, num_kv_heads, dim, generator=generator)
    expected_cache, actual_cache = prefix.clone(), prefix.clone()
    expected = reference_paged_attention(query, key, value, expected_cache, metadata, 0.4, None)
    group = GroupCoordinator(name="dcp", rank=0, world_size=1, ranks=[0])
    dcp = DecodeContextParallel(group, block_size)
    block_ids = np.array([block_tables[r][p // block_size] for r, count in enumerate(num_new)
                          for p in range(num_computed[r], num_computed[r] + count)])
    slots, metadata.context_parallel = dcp.local_slots(block_ids, positions.numpy(), torch.device("cpu"))
    metadata.slot_mapping = torch.from_numpy(slots)
    actual = DecodeContextParallelBackend().forward(query, key, value, actual_cache, metadata, 0.4, None)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(actual_cache, expected_cache)


def test_bfloat16_partials_merge_within_the_outputs_own_rounding() -> None:
    """bf16 inputs: scores, log-sum-exps and the merge run in float32, so the merged output is off the float32
    attention over the same bf16 values by no more than rounding that output to bf16 costs (twice, for margin)."""
    generator = torch.Generator().manual_seed(3)
    num_heads, dim, seq_len = 16, 64, 4096
    query = torch.randn(1, num_heads, dim, generator=generator).bfloat16()
    key = torch.randn(1, seq_len, dim, generator=generator).bfloat16()
    value = torch.randn(1, seq_len, dim, generator=generator).bfloat16()
    query_positions = torch.tensor([seq_len - 1])
    partials = [partial_attention(query, key[:, rank::2], value[:, rank::2], query_positions,
                                  torch.arange(rank, seq_len, 2), dim ** -0.5) for rank in range(2)]
    merged = merge_partial_attention(torch.stack([p[0] for p in partials]), torch.stack([p[1] for p in partials]))
    assert merged.dtype == torch.float32
    expected = _reference(query.float(), key.float(), value.float(), query_positions, dim ** -0.5, None)
    rounding = (expected.bfloat16().float() - expected).abs().max()
    assert (merged.bfloat16().float() - expected).abs().max() <= 2 * rounding
