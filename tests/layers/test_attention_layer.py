"""The Attention module: paged path (backend + KV cache) vs the metadata-free dummy path vs a dense
reference, with GQA and a sliding window."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from paged_inputs import build_attention_metadata
from pagedserve.attention import get_attention_backend
from pagedserve.attention.forward_context import set_forward_context
from pagedserve.layers.attention import Attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8


def _dense_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     sliding_window: int | None) -> torch.Tensor:
    num_tokens = query.shape[0]
    key = key.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    value = value.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query, key) / math.sqrt(HEAD_DIM)
    rows = torch.arange(num_tokens).unsqueeze(1)
    columns = torch.arange(num_tokens).unsqueeze(0)
    visible = columns <= rows
    if sliding_window is not None:
        visible &= columns > rows - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", F.softmax(scores, dim=-1), value).reshape(num_tokens, -1)


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_paged_and_dummy_paths_match_dense_attention(sliding_window: int | None) -> None:
    num_tokens, block_size = 21, 4
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=generator)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    expected = _dense_reference(query, key, value, sliding_window)
    layer = Attention(NUM_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, NUM_KV_HEADS, sliding_window=sliding_window,
                      prefix="layers.0.attn")
    flat = (query.reshape(num_tokens, -1), key.reshape(num_tokens, -1), value.reshape(num_tokens, -1))

    with set_forward_context(None):
        dummy = layer(*flat)
    torch.testing.assert_close(dummy, expected, atol=1e-5, rtol=1e-5)
    assert layer.kv_cache is None  # the dummy path never needs a cache

    layer.kv_cache = torch.zeros(2, 12, block_size, NUM_KV_HEADS, HEAD_DIM)
    blocks = [7, 3, 9, 1, 11, 5]
    # Two steps: a 13-token chunk, then the remaining 8 tokens against the cached context.
    first, positions = build_attention_metadata([13], [0], [blocks], block_size)
    with set_forward_context(first):
        head = layer(*(t[:13] for t in flat))
    second, _ = build_attention_metadata([8], [13], [blocks], block_size)
    with set_forward_context(second):
        tail = layer(*(t[13:] for t in flat))
    torch.testing.assert_close(torch.cat([head, tail]), expected, atol=1e-5, rtol=1e-5)
    assert positions.tolist() == list(range(13))
    # K/V really live in the cache at the request's slots.
    cached_keys = layer.kv_cache[0, blocks].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:num_tokens]
    torch.testing.assert_close(cached_keys, key)


def test_missing_cache_and_bad_head_counts_are_reported() -> None:
    layer = Attention(NUM_HEADS, HEAD_DIM, 1.0, NUM_KV_HEADS, prefix="layers.3.attn")
    metadata, _ = build_attention_metadata([2], [0], [[1]], 4)
    with set_forward_context(metadata), pytest.raises(RuntimeError, match="layers.3.attn: .*no kv_cache"):
        layer(torch.zeros(2, NUM_HEADS * HEAD_DIM), torch.zeros(2, NUM_KV_HEADS * HEAD_DIM),
              torch.zeros(2, NUM_KV_HEADS * HEAD_DIM))
    with pytest.raises(ValueError, match="num_heads=4 must be a positive multiple of num_kv_heads=3"):
        Attention(4, HEAD_DIM, 1.0, 3)


def test_backend_registry() -> None:
    assert get_attention_backend("torch_paged").name == "torch_paged"
    with pytest.raises(ValueError, match="attention backend='nope' is not supported; supported: \\['cpu_native', "
                                         "'decode_context_parallel', 'torch_paged'\\]"):
        get_attention_backend("nope")
