"""DeepSeek sparse attention vs dense MLA: one layer's decode attention at long contexts (issue #31's measure).

One request decoding at context lengths 1k-32k over a paged latent cache, DeepSeek-V3.2's attention dimensions
(128 heads on one rank, kv_lora_rank 512, rope 64, nope 128, v 128; indexer 64 heads x 128, index_topk 2048),
block_size 16, shuffled block ids, float32:
  dense   mla_paged.attend_absorbed_decodes over the whole context (the same layer forced dense)
  DSA     lightning_indexer.select_tokens over every key + sparse_mla.gather_selected_rows and
          attend_selected_decodes over the top 2048
Both include only the attention op (the projections around it are the same for both). The indexer reads every
key, so DSA still grows with the context, by index_head_dim floats a token instead of the latent's 576 x heads.

Usage: PYTHONPATH=. python benchmarks/dsa_decode_attention.py [--contexts 1024 4096 16384 32768] [--heads 128]
       [--repeats 5] [--threads 2]
Prints ms per layer (median of interleaved repeats) and the DSA / dense ratio per context.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.lightning_indexer import select_tokens
from pagedserve.attention.mla_paged import attend_absorbed_decodes
from pagedserve.attention.sparse_mla import attend_selected_decodes, gather_selected_rows

BLOCK_SIZE = 16
KV_LORA_RANK, ROPE, NOPE, V_HEAD_DIM = 512, 64, 128, 128
INDEX_HEADS, INDEX_HEAD_DIM = 64, 128


def _metadata(context: int, block_table: torch.Tensor) -> AttentionMetadata:
    return AttentionMetadata(
        num_actual_tokens=1, slot_mapping=torch.zeros(1, dtype=torch.long),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=torch.tensor([context], dtype=torch.int32),
        block_table=block_table, max_query_len=1, max_seq_len=context, num_decodes=1, num_decode_tokens=1,
        query_start_loc_cpu=[0, 1], seq_lens_cpu=[context], block_size=BLOCK_SIZE)


def _median_ms(function: Callable[[], object], repeats: int) -> float:
    function()  # warm-up: allocator and kernels
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run(context: int, num_heads: int, top_k: int, repeats: int) -> tuple[float, float]:
    generator = torch.Generator().manual_seed(context)
    num_blocks = context // BLOCK_SIZE + 1
    latent_cache = torch.randn(num_blocks + 1, BLOCK_SIZE, KV_LORA_RANK + ROPE, generator=generator)
    key_cache = torch.randn(num_blocks + 1, BLOCK_SIZE, INDEX_HEAD_DIM, generator=generator)
    block_table = (torch.randperm(num_blocks, generator=generator) + 1).to(torch.int32)[None, :]
    q_nope = torch.randn(1, num_heads, NOPE, generator=generator)
    q_pe = torch.randn(1, num_heads, ROPE, generator=generator)
    kv_b_weight = torch.randn(num_heads * (NOPE + V_HEAD_DIM), KV_LORA_RANK, generator=generator) * 0.02
    index_query = torch.randn(1, INDEX_HEADS, INDEX_HEAD_DIM, generator=generator)
    index_weights = torch.randn(1, INDEX_HEADS, generator=generator) * INDEX_HEADS ** -0.5
    metadata = _metadata(context, block_table)
    scale = (NOPE + ROPE) ** -0.5

    def dense() -> torch.Tensor:
        return attend_absorbed_decodes(q_nope, q_pe, latent_cache, block_table, [context], kv_b_weight,
                                       KV_LORA_RANK, V_HEAD_DIM, scale)

    def sparse() -> torch.Tensor:
        selection = select_tokens(index_query, index_weights, key_cache, metadata, top_k, INDEX_HEAD_DIM ** -0.5)
        rows = gather_selected_rows(latent_cache, block_table, selection)
        return attend_selected_decodes(q_nope, q_pe, rows, selection, kv_b_weight, KV_LORA_RANK, V_HEAD_DIM, scale)

    dense_times, sparse_times = [], []
    for _ in range(repeats):  # interleaved, so drift on a shared machine hits both alike
        dense_times.append(_median_ms(dense, 1))
        sparse_times.append(_median_ms(sparse, 1))
    return statistics.median(dense_times), statistics.median(sparse_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"heads={args.heads} index_topk={args.top_k} threads={args.threads} float32, ms per layer (median)")
    print(f"{'context':>8} {'dense':>9} {'DSA':>9} {'DSA/dense':>10}")
    for context in args.contexts:
        dense_ms, sparse_ms = run(context, args.heads, args.top_k, args.repeats)
        print(f"{context:>8} {dense_ms:>9.2f} {sparse_ms:>9.2f} {sparse_ms / dense_ms:>10.3f}")


if __name__ == "__main__":
    main()
