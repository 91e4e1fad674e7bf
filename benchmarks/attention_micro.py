"""Micro-benchmark of one decode step of the torch_paged attention backend on the CPU.

Shape of the product benchmark: 64 concurrent requests (prompts 64-512 tokens, outputs 64-256, so decode
contexts of 65-768 tokens), SmolLM2-135M attention (9 heads, 3 KV heads, head_dim 64), block_size 16,
shuffled block ids. Times one layer's decode step (K/V write + attention) for:
  loop (reference)  one SDPA call per request (the `reference_paged_attention` oracle)
  first batched     one gather (advanced indexing) + one SDPA call with enable_gqa and a boolean mask
  one chunk         the shipped decode path with chunking off: one index_select gather + one SDPA call
  chunks <= N MB    the shipped path: requests sorted by context length, one gather + SDPA call per chunk
                    of at most N MB of gathered K/V (`*` marks the shipped DECODE_CHUNK_BYTES)
and a prefill step through the backend: four 512-token chunks, two of them behind a cached prefix.

Usage: python benchmarks/attention_micro.py [--threads 2] [--repeats 20] [--num-requests 64]
Per-layer milliseconds (min and median over interleaved repeats; on a shared machine the minimum is the
steadier figure); "x30" is the per-step cost for a 30-layer model.

Recorded 2026-11-29, torch 2.13.0+cpu, --threads 1 --repeats 15 on the 2-core dev machine while other
jobs ran (with --threads 2 that machine was oversubscribed and every variant got slower than with one):
  decode min ms/layer      bf16    fp32
    loop (reference)       8.04   13.23
    first batched         15.02   51.53
    one chunk             11.49   46.61
    chunks <= 2 MB (*)     6.23   10.22
  prefill 4x512 tokens: bf16 17.5 ms/layer (117k tok/s), fp32 38.4 ms/layer (53k tok/s)
"""
from __future__ import annotations

import argparse
import contextlib
import math
import random
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from pagedserve.attention import torch_paged
from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.torch_paged import TorchPagedAttentionBackend, reference_paged_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def build_decode_step(seq_lens: list[int], dtype: torch.dtype, seed: int = 0
                      ) -> tuple[torch.Tensor, ...]:
    """A filled cache with shuffled blocks and a decode step whose contexts end at `seq_lens`."""
    rng = random.Random(seed)
    blocks_per_request = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_request) + 1
    block_ids = list(range(1, num_blocks))
    rng.shuffle(block_ids)
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    max_blocks = max(blocks_per_request)
    rows, slots, cursor = [], [], 0
    for num_request_blocks, seq_len in zip(blocks_per_request, seq_lens):
        row = block_ids[cursor:cursor + num_request_blocks]
        cursor += num_request_blocks
        rows.append(row + [0] * (max_blocks - len(row)))
        position = seq_len - 1
        slots.append(row[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
    num_seqs = len(seq_lens)
    metadata = AttentionMetadata(
        num_actual_tokens=num_seqs, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor(rows, dtype=torch.int32), max_query_len=1, max_seq_len=max(seq_lens),
        num_decodes=num_seqs, num_decode_tokens=num_seqs, query_start_loc_cpu=list(range(num_seqs + 1)),
        seq_lens_cpu=list(seq_lens), block_size=BLOCK_SIZE,
    )
    query = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM).to(dtype)
    key = torch.randn(num_seqs, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    value = torch.randn(num_seqs, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    return query, key, value, kv_cache, metadata


def batched_enable_gqa(query, key, value, kv_cache, metadata, scale, sliding_window=None):
    """One SDPA call with enable_gqa=True over [B, H, 1, D] queries, boolean mask, advanced indexing:
    the first batched version, kept to show what the shipped one gained."""
    torch_paged.write_to_kv_cache(key, value, kv_cache, metadata.slot_mapping)
    batch = query.shape[0]
    num_used_blocks = math.ceil(max(metadata.seq_lens_cpu) / BLOCK_SIZE)
    padded_len = num_used_blocks * BLOCK_SIZE
    context = kv_cache[:, metadata.block_table[:, :num_used_blocks]]
    context = context.reshape(2, batch, padded_len, NUM_KV_HEADS, HEAD_DIM).transpose(2, 3)
    mask = torch.arange(padded_len)[None, :] < metadata.seq_lens.long()[:, None]
    out = F.scaled_dot_product_attention(query[:, :, None, :], context[0], context[1],
                                         attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
    return out[:, :, 0, :]


@contextlib.contextmanager
def decode_chunk_bytes(chunk_bytes: int):
    saved = torch_paged.DECODE_CHUNK_BYTES
    torch_paged.DECODE_CHUNK_BYTES = chunk_bytes
    try:
        yield
    finally:
        torch_paged.DECODE_CHUNK_BYTES = saved


def time_calls(functions: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, float]]:
    """(min, median) milliseconds per function. Calls are interleaved round-robin so that load from other
    processes on a shared machine hits every variant alike; the minimum is the steadier figure."""
    for function in functions.values():
        function()  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            start = time.perf_counter()
            function()
            samples[name].append(time.perf_counter() - start)
    return {name: (min(times) * 1e3, statistics.median(times) * 1e3) for name, times in samples.items()}


def benchmark_decode(num_requests: int, dtype: torch.dtype, repeats: int) -> None:
    rng = random.Random(1)
    # Context = prompt (64-512) + tokens generated so far (0..output length 64-256).
    seq_lens = [rng.randint(64, 512) + rng.randint(0, rng.randint(64, 256)) + 1 for _ in range(num_requests)]
    query, key, value, kv_cache, metadata = build_decode_step(seq_lens, dtype)
    scale = HEAD_DIM ** -0.5
    backend = TorchPagedAttentionBackend()
    print(f"\ndecode, {dtype}, {num_requests} requests, contexts {min(seq_lens)}-{max(seq_lens)} "
          f"(sum {sum(seq_lens)}, padded to the longest {num_requests * max(seq_lens)})")
    expected = reference_paged_attention(query, key, value, kv_cache, metadata, scale).float()

    def shipped(chunk_bytes: int) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with decode_chunk_bytes(chunk_bytes):
                return backend.forward(query, key, value, kv_cache, metadata, scale)
        return run

    variants: dict[str, Callable[[], torch.Tensor]] = {
        "loop (reference)": lambda: reference_paged_attention(query, key, value, kv_cache, metadata, scale),
        "first batched": lambda: batched_enable_gqa(query, key, value, kv_cache, metadata, scale),
        "one chunk": shipped(1 << 40),
    }
    for megabytes in (16, 8, 4, 2, 1, 0.5):
        shipped_mark = " *" if int(megabytes * 2**20) == torch_paged.DECODE_CHUNK_BYTES else ""
        variants[f"chunks <= {megabytes} MB{shipped_mark}"] = shipped(int(megabytes * 2**20))
    errors = {name: (function().float() - expected).abs().max().item() for name, function in variants.items()}
    for name, (best, median) in time_calls(variants, repeats).items():
        error = errors[name]
        print(f"  {name:<18} min {best:8.2f}  median {median:8.2f} ms/layer   x30 (min) = {30 * best:7.1f} "
              f"ms/step   max|diff vs loop| {error:.1e}")


def benchmark_prefill(dtype: torch.dtype, repeats: int) -> None:
    """Four 512-token chunks, two of them continuing a cached prefix (the chunked-prefill shape)."""
    chunk, cached = 512, [0, 0, 256, 512]
    seq_lens = [c + chunk for c in cached]
    query, key, value, kv_cache, metadata = build_decode_step(seq_lens, dtype)
    num_tokens = chunk * len(seq_lens)
    slots = []
    for row, seq_len in zip(metadata.block_table.tolist(), seq_lens):
        slots += [row[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len - chunk, seq_len)]
    starts = [chunk * i for i in range(len(seq_lens) + 1)]
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens, slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts),
        seq_lens=metadata.seq_lens, block_table=metadata.block_table, max_query_len=chunk,
        max_seq_len=max(seq_lens), num_decodes=0, num_decode_tokens=0, query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens, block_size=BLOCK_SIZE)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM).to(dtype)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    backend = TorchPagedAttentionBackend()
    (milliseconds, _), = time_calls(
        {"prefill": lambda: backend.forward(query, key, value, kv_cache, metadata, HEAD_DIM ** -0.5)},
        max(3, repeats // 4)).values()
    print(f"\nprefill, {dtype}, 4 chunks of {chunk} tokens (cached prefixes {cached}): "
          f"{milliseconds:.2f} ms/layer = {num_tokens / milliseconds * 1e3:,.0f} tok/s/layer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--num-requests", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads")
    for dtype in (torch.bfloat16, torch.float32):
        benchmark_decode(args.num_requests, dtype, args.repeats)
    for dtype in (torch.bfloat16, torch.float32):
        benchmark_prefill(dtype, args.repeats)


if __name__ == "__main__":
    main()
