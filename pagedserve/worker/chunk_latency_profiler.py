"""Time forward passes of several prefill-chunk lengths at start (profiling-tuned chunked prefill).

Each measurement is one real forward of `n` dummy tokens of a single sequence with `h` tokens of
history, plus the logits of its last position, as a prefill chunk would run. It runs before the engine
accepts requests, so the whole KV cache is free: the chunk writes its K/V into blocks 1.. (never block
0, the null block) and attends to whatever those blocks hold. No request can see that data: blocks are
written by their request before being read, and nothing is in the prefix cache yet.
"""
from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.forward_context import set_forward_context
from pagedserve.core.profiling_chunk_predictor import LatencySample


def profile_points(chunk_sizes: tuple[int, ...], history_sizes: tuple[int, ...], max_num_batched_tokens: int,
                   max_model_len: int, max_cached_tokens: int) -> list[tuple[int, int]]:
    """(chunk, history) pairs that fit the token budget, the model length and the KV cache."""
    chunks = sorted({n for n in chunk_sizes if n <= max_num_batched_tokens})
    points = [(n, 0) for n in chunks]
    if chunks:
        history_chunk = min(chunks, key=lambda n: abs(n - 256))
        points += [(history_chunk, h) for h in sorted(set(history_sizes))]
    return [(n, h) for n, h in points if n + h <= min(max_model_len, max_cached_tokens)]


def _metadata(num_tokens: int, num_history: int, block_size: int, device: torch.device) -> AttentionMetadata:
    seq_len = num_history + num_tokens
    num_blocks = -(-seq_len // block_size)
    block_table = np.arange(1, num_blocks + 1, dtype=np.int32)[None, :]  # scratch blocks 1..
    positions = np.arange(num_history, seq_len)
    slot_mapping = block_table[0, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return AttentionMetadata(
        num_actual_tokens=num_tokens,
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
        block_table=torch.from_numpy(block_table).to(device),
        max_query_len=num_tokens,
        max_seq_len=seq_len,
        num_decodes=1 if num_tokens == 1 else 0,
        num_decode_tokens=1 if num_tokens == 1 else 0,
        query_start_loc_cpu=[0, num_tokens],
        seq_lens_cpu=[seq_len],
        block_size=block_size,
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def profile_chunk_latencies(model: nn.Module, device: torch.device, block_size: int, vocab_size: int,
                            points: list[tuple[int, int]], num_repeats: int = 2) -> list[LatencySample]:
    """One LatencySample per (chunk, history) point: the fastest of `num_repeats` timed forwards."""
    samples: list[LatencySample] = []
    warmed_up = False
    for num_tokens, num_history in points:
        metadata = _metadata(num_tokens, num_history, block_size, device)
        input_ids = (torch.arange(num_tokens, device=device) * 7919 + 3) % vocab_size
        positions = torch.arange(num_history, num_history + num_tokens, device=device)
        best = float("inf")
        for repeat in range(num_repeats + (0 if warmed_up else 1)):
            _synchronize(device)
            start = time.perf_counter()
            with set_forward_context(metadata):
                hidden_states = model(input_ids, positions)
            model.compute_logits(hidden_states[-1:])
            _synchronize(device)
            elapsed = time.perf_counter() - start
            if warmed_up or repeat > 0:  # the very first forward (lazy init, allocations) is discarded
                best = min(best, elapsed)
        warmed_up = True
        samples.append(LatencySample(num_tokens, num_history, best))
    return samples


__all__ = ["profile_chunk_latencies", "profile_points"]
