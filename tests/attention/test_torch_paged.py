"""TorchPagedAttentionBackend against a dense float64 reference on contiguous per-request tensors.

A small simulator keeps each request's full Q/K/V history, hands out blocks from a shuffled pool (never
the null block 0), builds the step's AttentionMetadata the way the model runner does, and compares the
backend's output for the new tokens with plain causal attention over the request's whole history.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
import torch

from pagedserve.attention import torch_paged
from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.torch_paged import (
    TorchPagedAttentionBackend,
    _decode_chunks,
    reference_paged_attention,
)

BLOCK_SIZE = 4
HEAD_DIM = 16


@dataclass
class _Request:
    keys: torch.Tensor  # [num_tokens, H_kv, D] float64, the whole history
    values: torch.Tensor
    block_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[0]


class _Simulator:
    """Drives one layer's paged cache over several steps, with a dense oracle beside it."""

    def __init__(self, num_heads: int, num_kv_heads: int, dtype: torch.dtype, num_blocks: int = 96,
                 seed: int = 0, shuffle_blocks: bool = True) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.dtype = dtype
        self.generator = torch.Generator().manual_seed(seed)
        self.kv_cache = torch.zeros(2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, dtype=dtype)
        self.free_block_ids = list(range(1, num_blocks))  # block 0 is the null block
        if shuffle_blocks:
            random.Random(seed).shuffle(self.free_block_ids)
        self.requests: dict[int, _Request] = {}
        self.scale = 1.0 / math.sqrt(HEAD_DIM)

    def _random(self, *shape: int) -> torch.Tensor:
        # Values rounded to the cache dtype, so the oracle and the backend see the same numbers.
        return torch.randn(*shape, generator=self.generator, dtype=torch.float64).to(self.dtype).double()

    def step(self, schedule: list[tuple[int, int]], backend_forward=None, sliding_window: int | None = None,
             num_padding_tokens: int = 0, is_fused_qkv: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs one step; `schedule` lists (request_id, num_new_tokens). Returns (backend, oracle) outputs."""
        queries, keys, values, slots, query_start_loc, seq_lens, block_rows = [], [], [], [], [0], [], []
        for request_id, num_new in schedule:
            request = self.requests.setdefault(
                request_id, _Request(torch.empty(0, self.num_kv_heads, HEAD_DIM, dtype=torch.float64),
                                     torch.empty(0, self.num_kv_heads, HEAD_DIM, dtype=torch.float64)))
            start = request.num_tokens
            new_key = self._random(num_new, self.num_kv_heads, HEAD_DIM)
            new_value = self._random(num_new, self.num_kv_heads, HEAD_DIM)
            request.keys = torch.cat([request.keys, new_key])
            request.values = torch.cat([request.values, new_value])
            while len(request.block_ids) * BLOCK_SIZE < request.num_tokens:
                request.block_ids.append(self.free_block_ids.pop())
            for position in range(start, request.num_tokens):
                slots.append(request.block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
            queries.append(self._random(num_new, self.num_heads, HEAD_DIM))
            keys.append(new_key)
            values.append(new_value)
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(request.num_tokens)
            block_rows.append(list(request.block_ids))
        max_num_blocks = max(len(row) for row in block_rows)
        block_table = torch.tensor([row + [0] * (max_num_blocks - len(row)) for row in block_rows],
                                   dtype=torch.int32)
        num_decodes = 0
        for _, num_new in schedule:
            if num_new != 1:
                break
            num_decodes += 1
        num_tokens = query_start_loc[-1]
        metadata = AttentionMetadata(
            num_actual_tokens=num_tokens,
            slot_mapping=torch.tensor(slots + [0] * num_padding_tokens, dtype=torch.int64),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=block_table,
            max_query_len=max(n for _, n in schedule),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            block_size=BLOCK_SIZE,
        )
        padding = lambda t: torch.cat([t, torch.zeros(num_padding_tokens, *t.shape[1:], dtype=t.dtype)])
        query = padding(torch.cat(queries)).to(self.dtype)
        key = padding(torch.cat(keys)).to(self.dtype)
        value = padding(torch.cat(values)).to(self.dtype)
        if is_fused_qkv:
            # As the Attention layer passes them: strided views into one fused QKV projection output.
            fused = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], dim=1)
            query_part, key_part, value_part = fused.split(
                [self.num_heads * HEAD_DIM, self.num_kv_heads * HEAD_DIM, self.num_kv_heads * HEAD_DIM], dim=1)
            query = query_part.view(-1, self.num_heads, HEAD_DIM)
            key = key_part.view(-1, self.num_kv_heads, HEAD_DIM)
            value = value_part.view(-1, self.num_kv_heads, HEAD_DIM)
            assert not key.is_contiguous()
        forward = backend_forward or TorchPagedAttentionBackend().forward
        output = forward(query, key, value, self.kv_cache, metadata, self.scale, sliding_window)
        expected = torch.cat([
            _dense_attention(q, self.requests[request_id], self.scale, sliding_window)
            for (request_id, _), q in zip(schedule, queries)
        ])
        assert output.shape == query.shape and output.dtype == self.dtype
        assert torch.all(output[num_tokens:] == 0)
        return output[:num_tokens].double(), expected


def _dense_attention(query: torch.Tensor, request: _Request, scale: float,
                     sliding_window: int | None) -> torch.Tensor:
    """Plain causal attention in float64 for the request's last q_len tokens, written out by hand."""
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = request.keys.shape
    group = num_heads // num_kv_heads
    keys = request.keys.repeat_interleave(group, dim=1)  # [seq_len, H, D]
    values = request.values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
    query_positions = torch.arange(seq_len - q_len, seq_len)[:, None]
    key_positions = torch.arange(seq_len)[None, :]
    allowed = key_positions <= query_positions
    if sliding_window is not None:
        allowed &= key_positions > query_positions - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values)


TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]
FORWARDS = {"backend": None, "reference": reference_paged_attention}


def _check(simulator: _Simulator, schedule: list[tuple[int, int]], **kwargs) -> None:
    output, expected = simulator.step(schedule, **kwargs)
    torch.testing.assert_close(output, expected, **TOLERANCES[simulator.dtype])


@pytest.fixture(params=list(FORWARDS), ids=list(FORWARDS))
def forward_kind(request) -> str:
    return request.param


def _forward(kind: str):
    return FORWARDS[kind]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pure_prefill(dtype: torch.dtype, forward_kind: str) -> None:
    simulator = _Simulator(num_heads=4, num_kv_heads=4, dtype=dtype)
    _check(simulator, [(0, 7), (1, 1), (2, 13)], backend_forward=_forward(forward_kind))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_with_cached_prefix(dtype: torch.dtype, forward_kind: str) -> None:
    simulator = _Simulator(num_heads=4, num_kv_heads=2, dtype=dtype)
    simulator.step([(0, 9), (1, 4)], backend_forward=_forward(forward_kind))  # writes the prefix
    _check(simulator, [(0, 6), (1, 11)], backend_forward=_forward(forward_kind))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_prefill_across_two_calls(dtype: torch.dtype, forward_kind: str) -> None:
    simulator = _Simulator(num_heads=6, num_kv_heads=2, dtype=dtype)
    _check(simulator, [(0, 10)], backend_forward=_forward(forward_kind))
    _check(simulator, [(0, 7)], backend_forward=_forward(forward_kind))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_batches(dtype: torch.dtype, forward_kind: str) -> None:
    simulator = _Simulator(num_heads=6, num_kv_heads=3, dtype=dtype, num_blocks=160)
    prompt_lens = [3, 17, 8, 1, 30, 12, 5, 22, 9, 2, 14, 27]
    simulator.step([(i, n) for i, n in enumerate(prompt_lens)], backend_forward=_forward(forward_kind))
    for _ in range(5):
        _check(simulator, [(i, 1) for i in range(len(prompt_lens))], backend_forward=_forward(forward_kind))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_decode_and_prefill(dtype: torch.dtype, forward_kind: str) -> None:
    simulator = _Simulator(num_heads=4, num_kv_heads=1, dtype=dtype)
    simulator.step([(0, 5), (1, 9), (2, 3)], backend_forward=_forward(forward_kind))
    # Decodes first, then a new prompt, then a continued (chunked) prefill with a cached prefix.
    _check(simulator, [(0, 1), (1, 1), (3, 6), (2, 5)], backend_forward=_forward(forward_kind))
    _check(simulator, [(0, 1), (1, 1), (2, 1), (3, 1), (4, 11)], backend_forward=_forward(forward_kind))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gqa_matches_expanded_heads(dtype: torch.dtype) -> None:
    simulator = _Simulator(num_heads=9, num_kv_heads=3, dtype=dtype)
    simulator.step([(0, 6), (1, 10)])
    _check(simulator, [(0, 1), (1, 1), (2, 7)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [5, 8])
def test_sliding_window_prefill_and_decode_past_window(dtype: torch.dtype, forward_kind: str, window: int) -> None:
    simulator = _Simulator(num_heads=4, num_kv_heads=2, dtype=dtype)
    # Prompt longer than the window, then a chunk with a cached prefix, then decodes past the window.
    _check(simulator, [(0, 13), (1, 3)], backend_forward=_forward(forward_kind), sliding_window=window)
    _check(simulator, [(1, 1), (0, 6)], backend_forward=_forward(forward_kind), sliding_window=window)
    for _ in range(4):
        _check(simulator, [(0, 1), (1, 1)], backend_forward=_forward(forward_kind), sliding_window=window)


def test_sliding_window_matches_transformers_mistral_mask() -> None:
    """Our window rule is the one transformers builds for Mistral: a window of w tokens including itself."""
    from transformers import MistralConfig
    from transformers.masking_utils import create_sliding_window_causal_mask

    window, seq_len = 4, 11
    config = MistralConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                           intermediate_size=16, vocab_size=10, sliding_window=window)
    config._attn_implementation = "eager"
    hf_mask = create_sliding_window_causal_mask(
        config=config, inputs_embeds=torch.zeros(1, seq_len, 16), attention_mask=None, cache=None,
        position_ids=torch.arange(seq_len)[None], allow_is_causal_skip=False,
    )[0, 0] == 0
    positions = torch.arange(seq_len)
    ours = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - window)
    assert torch.equal(hf_mask, ours)
    assert int(hf_mask[-1].sum()) == window


@pytest.mark.parametrize("shuffle_blocks", [False, True], ids=["ordered", "shuffled"])
def test_block_table_layout(shuffle_blocks: bool, forward_kind: str) -> None:
    simulator = _Simulator(num_heads=2, num_kv_heads=2, dtype=torch.float32, shuffle_blocks=shuffle_blocks,
                           seed=3)
    # Interleaved growth makes each request's blocks non-contiguous even with an ordered pool.
    for step in range(4):
        _check(simulator, [(0, 3), (1, 5), (2, 2)], backend_forward=_forward(forward_kind))
    assert any(b - a != 1 for a, b in zip(simulator.requests[1].block_ids, simulator.requests[1].block_ids[1:]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_many_decodes_of_mixed_lengths_in_several_chunks(dtype: torch.dtype, monkeypatch) -> None:
    # A small chunk budget (150 tokens of K+V) splits the decode batch into many chunks, some of a single
    # request longer than the budget.
    bytes_per_token = 2 * 2 * HEAD_DIM * torch.empty(0, dtype=dtype).element_size()
    monkeypatch.setattr(torch_paged, "DECODE_CHUNK_BYTES", 150 * bytes_per_token)
    simulator = _Simulator(num_heads=4, num_kv_heads=2, dtype=dtype, num_blocks=800, seed=5)
    lengths = [2 + 3 * i for i in range(40)]
    random.Random(1).shuffle(lengths)
    simulator.step([(i, n) for i, n in enumerate(lengths)])
    for _ in range(2):
        _check(simulator, [(i, 1) for i in range(len(lengths))])
    _check(simulator, [(i, 1) for i in range(len(lengths))], sliding_window=7)


def test_decode_chunks_respect_the_token_budget() -> None:
    seq_lens = [5, 300, 40, 41, 7, 120, 39, 1, 64]
    chunks = _decode_chunks(seq_lens, max_chunk_tokens=128)
    assert sorted(index for chunk in chunks for index in chunk) == list(range(len(seq_lens)))
    flat = [seq_lens[index] for chunk in chunks for index in chunk]
    assert flat == sorted(seq_lens, reverse=True)
    for chunk in chunks:
        longest = seq_lens[chunk[0]]
        assert longest == max(seq_lens[index] for index in chunk)
        assert len(chunk) == 1 or longest * len(chunk) <= 128
    assert [seq_lens[index] for index in chunks[0]] == [300]  # over budget alone: its own chunk


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_views_of_a_fused_qkv_projection(dtype: torch.dtype, forward_kind: str) -> None:
    simulator = _Simulator(num_heads=9, num_kv_heads=3, dtype=dtype)
    _check(simulator, [(0, 7), (1, 12)], backend_forward=_forward(forward_kind), is_fused_qkv=True)
    _check(simulator, [(0, 1), (1, 1), (2, 6)], backend_forward=_forward(forward_kind),
           is_fused_qkv=True)
    _check(simulator, [(0, 1), (1, 1), (2, 1)], backend_forward=_forward(forward_kind), sliding_window=4,
           is_fused_qkv=True)


def test_padding_rows_are_zero_and_not_attended() -> None:
    simulator = _Simulator(num_heads=4, num_kv_heads=2, dtype=torch.float32)
    simulator.step([(0, 6)])
    _check(simulator, [(0, 1), (1, 4)], num_padding_tokens=3)


def test_null_block_is_never_written(forward_kind: str) -> None:
    simulator = _Simulator(num_heads=4, num_kv_heads=2, dtype=torch.float32)
    simulator.kv_cache[:, 0] = 7.0  # a sentinel the backend must leave untouched
    # Padding rows map to slot 0 (inside the null block): they must not be written either.
    simulator.step([(0, 9), (1, 2)], backend_forward=_forward(forward_kind), num_padding_tokens=3)
    simulator.step([(0, 1), (1, 1), (2, 5)], backend_forward=_forward(forward_kind), num_padding_tokens=1)
    assert torch.all(simulator.kv_cache[:, 0] == 7.0)
    # ...and the sentinel in the null block (block-table padding) never leaks into outputs.
    _check(simulator, [(0, 1), (1, 1), (2, 1)], backend_forward=_forward(forward_kind))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backend_agrees_with_reference_loop(dtype: torch.dtype) -> None:
    """The batched decode path and the per-request loop agree on identical inputs and caches."""
    fast = _Simulator(num_heads=9, num_kv_heads=3, dtype=dtype, num_blocks=200, seed=7)
    slow = _Simulator(num_heads=9, num_kv_heads=3, dtype=dtype, num_blocks=200, seed=7)
    prompts = [(i, 3 + 4 * i) for i in range(12)]
    decodes = [(i, 1) for i in range(12)]
    for schedule in (prompts, decodes, decodes + [(12, 5)]):
        fast_output, _ = fast.step(schedule)
        slow_output, _ = slow.step(schedule, backend_forward=reference_paged_attention)
        torch.testing.assert_close(fast_output, slow_output, **TOLERANCES[dtype])
    assert torch.equal(fast.kv_cache, slow.kv_cache)


def test_invalid_inputs_raise_value_error() -> None:
    backend = TorchPagedAttentionBackend()
    cache = torch.zeros(2, 4, BLOCK_SIZE, 2, HEAD_DIM)
    metadata = AttentionMetadata(
        num_actual_tokens=1, slot_mapping=torch.tensor([4]), query_start_loc=torch.tensor([0, 1]),
        seq_lens=torch.tensor([1]), block_table=torch.tensor([[1]], dtype=torch.int32), max_query_len=1,
        max_seq_len=1, num_decodes=0, num_decode_tokens=0, query_start_loc_cpu=[0, 1], seq_lens_cpu=[1],
        block_size=BLOCK_SIZE)
    key = torch.zeros(1, 2, HEAD_DIM)
    with pytest.raises(ValueError, match="num_heads=3"):
        backend.forward(torch.zeros(1, 3, HEAD_DIM), key, key, cache, metadata, 1.0)
    with pytest.raises(ValueError, match="sliding_window=0"):
        backend.forward(torch.zeros(1, 4, HEAD_DIM), key, key, cache, metadata, 1.0, sliding_window=0)
    with pytest.raises(ValueError, match="num_decodes=2"):
        metadata.num_decodes = metadata.num_decode_tokens = 2
        backend.forward(torch.zeros(1, 4, HEAD_DIM), key, key, cache, metadata, 1.0)
