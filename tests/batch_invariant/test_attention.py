"""The batch-invariant paged attention: a token's output has the same bits alone, in any decode batch and
in any prefill chunk, and equals torch_paged's reference within rounding."""
from __future__ import annotations

import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from paged_inputs import build_attention_metadata  # noqa: E402

from pagedserve.attention.torch_paged import reference_paged_attention  # noqa: E402
from pagedserve.batch_invariant.attention import (  # noqa: E402
    KV_TILE,
    BatchInvariantPagedAttentionBackend,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 16, 256


class Scenario:
    """A target request of `seq_len` tokens (fixed random q/k/v) plus random neighbours, one step."""

    def __init__(self, seq_len: int, dtype: torch.dtype, sliding_window: int | None) -> None:
        generator = torch.Generator().manual_seed(seq_len)
        self.seq_len, self.dtype, self.sliding_window = seq_len, dtype, sliding_window
        self.query = torch.randn(seq_len, NUM_HEADS, HEAD_DIM, generator=generator).to(dtype)
        self.key = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
        self.value = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
        self.blocks = list(range(1, 1 + -(-seq_len // BLOCK_SIZE)))

    def run(self, backend, chunk_len: int, neighbours: list[tuple[int, int]], seed: int) -> tuple[torch.Tensor, ...]:
        """The target computes its last `chunk_len` tokens; neighbours are (cached, new) token counts.
        Returns (target's output rows, the full output, the step's inputs for a reference run)."""
        generator = torch.Generator().manual_seed(seed)
        cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=self.dtype)
        flat = cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)
        cached = self.seq_len - chunk_len
        for position in range(cached):
            slot = self.blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
            flat[0, slot], flat[1, slot] = self.key[position], self.value[position]
        end = self.seq_len
        target = (cached, chunk_len, self.blocks, self.query[cached:end], self.key[cached:end],
                  self.value[cached:end])
        requests, next_block = [], 1 + len(self.blocks)
        for num_cached, num_new in neighbours:
            blocks = list(range(next_block, next_block + -(-(num_cached + num_new) // BLOCK_SIZE)))
            next_block += len(blocks)
            for position in range(num_cached):
                slot = blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
                flat[:, slot] = torch.randn(2, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(self.dtype)
            requests.append((num_cached, num_new, blocks,
                             *(torch.randn(num_new, heads, HEAD_DIM, generator=generator).to(self.dtype)
                               for heads in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))))
        # The runner's order: single-token requests first, then the others; the target at a random place.
        requests.insert(random.Random(seed).randint(0, len(requests)), target)
        requests.sort(key=lambda request: request[1] != 1)
        metadata, _ = build_attention_metadata([r[1] for r in requests], [r[0] for r in requests],
                                               [r[2] for r in requests], BLOCK_SIZE)
        query, key, value = (torch.cat([r[i] for r in requests]) for i in (3, 4, 5))
        inputs = (query, key, value, cache.clone(), metadata)
        output = backend.forward(query, key, value, cache, metadata, HEAD_DIM ** -0.5, self.sliding_window)
        start = metadata.query_start_loc_cpu[requests.index(target)]
        return output[start:start + chunk_len], output, inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 40])
def test_token_output_identical_alone_in_batches_and_in_chunks(dtype: torch.dtype, sliding_window) -> None:
    backend = BatchInvariantPagedAttentionBackend()
    scenario = Scenario(2 * KV_TILE + 22, dtype, sliding_window)
    alone = scenario.run(backend, 1, [], seed=0)[0][-1]
    rng = random.Random(1)
    for chunk_len in (1, 2, 9, KV_TILE, KV_TILE + 1, scenario.seq_len):
        for trial in range(3):
            neighbours = [(rng.randint(0, 300), 1 if rng.random() < 0.6 else rng.randint(2, 40))
                          for _ in range(rng.randint(0, 9))]
            rows = scenario.run(backend, chunk_len, neighbours, seed=trial)[0]
            assert torch.equal(rows[-1], alone), (chunk_len, trial, neighbours)
            if chunk_len == scenario.seq_len and trial == 0:
                # Every earlier token of the chunk matches that token decoded alone, too.
                for position in (0, 5, KV_TILE - 1, KV_TILE, KV_TILE + 7):
                    prefix = Scenario(scenario.seq_len, dtype, sliding_window)
                    prefix.seq_len, prefix.blocks = position + 1, prefix.blocks[:position // BLOCK_SIZE + 1]
                    assert torch.equal(prefix.run(backend, 1, [], seed=0)[0][-1], rows[position]), position


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 40])
def test_equals_reference_within_rounding(dtype: torch.dtype, sliding_window) -> None:
    scenario = Scenario(150, dtype, sliding_window)
    neighbours = [(0, 30), (100, 1), (7, 1), (60, 12), (200, 1)]
    _, output, (query, key, value, cache, metadata) = scenario.run(
        BatchInvariantPagedAttentionBackend(), 17, neighbours, seed=3)
    expected = reference_paged_attention(query, key, value, cache, metadata, HEAD_DIM ** -0.5, sliding_window)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(output, expected, **tolerance)
