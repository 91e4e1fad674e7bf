"""LayerResidentBuffers.gather_decode_rows (the offloaded decode gather) against the plain gather from a resident
cache (attention/sparse_mla.gather_selected_rows): the same rows, bit for bit, over decode steps that append rows
to the tier, with buffers smaller than the selections' block span (several rounds) and with requests leaving."""
from __future__ import annotations

import torch

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.sparse_mla import attend_selected_decodes, gather_selected_rows
from pagedserve.core.sparse_kv_offload_stats import SparseKVOffloadStats
from pagedserve.sparse_kv_offload.layer_resident_buffers import LayerResidentBuffers, StepRequests

BLOCK_SIZE = 4
ROW_WIDTH = 6
TOP_K = 8


def _metadata(block_table: torch.Tensor, seq_lens: list[int]) -> AttentionMetadata:
    num = len(seq_lens)
    return AttentionMetadata(
        num_actual_tokens=num, slot_mapping=torch.zeros(num, dtype=torch.long),
        query_start_loc=torch.arange(num + 1, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table, max_query_len=1, max_seq_len=max(seq_lens), num_decodes=num, num_decode_tokens=num,
        query_start_loc_cpu=list(range(num + 1)), seq_lens_cpu=seq_lens, block_size=BLOCK_SIZE)


def _selection(generator: torch.Generator, seq_lens: list[int]) -> torch.Tensor:
    """Per row TOP_K distinct positions below its length, the newest always among them, -1 padded."""
    width = min(TOP_K, max(seq_lens))
    selection = torch.full((len(seq_lens), width), -1, dtype=torch.long)
    for row, seq_len in enumerate(seq_lens):
        others = torch.randperm(seq_len - 1, generator=generator)[:min(TOP_K, seq_len) - 1]
        chosen = torch.cat([torch.tensor([seq_len - 1]), others])
        selection[row, :len(chosen)] = chosen
    return selection


def test_offloaded_gather_equals_the_resident_cache_gather() -> None:
    generator = torch.Generator().manual_seed(0)
    num_blocks = 64
    tier = torch.zeros(num_blocks, BLOCK_SIZE, ROW_WIDTH)
    stats = SparseKVOffloadStats()
    step = StepRequests()
    buffers = LayerResidentBuffers(tier, capacity=3, step=step, stats=stats)
    # Two requests over disjoint, shuffled blocks (block 0 is the null block).
    order = torch.randperm(num_blocks - 1, generator=generator) + 1
    block_table = torch.stack([order[:16], order[16:32]]).to(torch.int32)
    seq_lens = [9, 22]
    for position in range(max(seq_lens)):  # the prompts' rows, written through to the tier
        for row, seq_len in enumerate(seq_lens):
            if position < seq_len - 1:
                block_id = int(block_table[row, position // BLOCK_SIZE])
                tier[block_id, position % BLOCK_SIZE] = torch.randn(ROW_WIDTH, generator=generator)
    for _ in range(24):
        for row, seq_len in enumerate(seq_lens):  # this step's new rows, written before the gather
            block_id = int(block_table[row, (seq_len - 1) // BLOCK_SIZE])
            tier[block_id, (seq_len - 1) % BLOCK_SIZE] = torch.randn(ROW_WIDTH, generator=generator)
        selection = _selection(generator, seq_lens)
        step.request_ids = ["a", "b"]
        metadata = _metadata(block_table, seq_lens)
        offloaded = buffers.gather_decode_rows(metadata, selection)
        plain = gather_selected_rows(tier, block_table, selection)
        is_selected = selection >= 0
        assert torch.equal(offloaded[is_selected], plain[is_selected])
        assert not offloaded[~is_selected].any()
        # Attention over them is bitwise the same (unselected entries are masked out).
        q_nope, q_pe = torch.randn(2, 2, 5, generator=generator), torch.randn(2, 2, 2, generator=generator)
        kv_b_weight = torch.randn(2 * (5 + 3), 4, generator=generator)
        assert torch.equal(attend_selected_decodes(q_nope, q_pe, offloaded, selection, kv_b_weight, 4, 3, 0.3),
                           attend_selected_decodes(q_nope, q_pe, plain, selection, kv_b_weight, 4, 3, 0.3))
        seq_lens = [seq_len + 1 for seq_len in seq_lens]
    assert stats.num_block_hits > 0 and stats.num_block_misses > 0
    assert stats.num_blocks_moved_in == stats.num_block_misses
    assert stats.num_multi_round_gathers > 0  # 8 selected positions span more than 3 blocks
    assert set(buffers.buffers) == {"a", "b"} and buffers.num_resident_blocks == 6
    buffers.free({"a"})
    assert set(buffers.buffers) == {"b"} and buffers.num_resident_blocks == 3


def test_a_resident_block_sees_rows_written_after_it_was_loaded() -> None:
    tier = torch.zeros(8, BLOCK_SIZE, ROW_WIDTH)
    step = StepRequests(request_ids=["a"])
    buffers = LayerResidentBuffers(tier, capacity=2, step=step, stats=SparseKVOffloadStats())
    block_table = torch.tensor([[5, 6]], dtype=torch.int32)
    tier[5, 0] = 1.0
    buffers.gather_decode_rows(_metadata(block_table, [1]), torch.tensor([[0]]))  # block 5 now resident
    tier[5, 1] = 2.0  # the next decode's row, written through to the tier only
    rows = buffers.gather_decode_rows(_metadata(block_table, [2]), torch.tensor([[1, 0]]))
    assert rows[0, 0].eq(2.0).all() and rows[0, 1].eq(1.0).all()


def test_a_forward_outside_the_steps_reads_the_tier_directly() -> None:
    """Start-up chunk profiling runs forwards before any step named its requests: no buffer is made."""
    tier = torch.randn(8, BLOCK_SIZE, ROW_WIDTH)
    buffers = LayerResidentBuffers(tier, capacity=2, step=StepRequests(), stats=SparseKVOffloadStats())
    block_table = torch.tensor([[3, 6]], dtype=torch.int32)
    selection = torch.tensor([[5, 0, -1]])
    rows = buffers.gather_decode_rows(_metadata(block_table, [6]), selection)
    assert torch.equal(rows[0, :2], torch.stack([tier[6, 1], tier[3, 0]])) and not buffers.buffers
