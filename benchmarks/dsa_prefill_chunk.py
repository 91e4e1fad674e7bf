"""One prefill chunk of DeepSeek sparse attention at a given context, for extrapolating prompts too long to run: the
lightning indexer's selection for the chunk's tokens (lightning_indexer.select_request_tokens: scored against every
earlier key) and the gathered sparse attention over the selected rows (sparse_mla.attend_selected_prefills), timed
apart, for one layer of the sparse KV offload benchmark's model (sparse_kv_offload.py MODEL_SHAPE: 8 index heads of
64 dims, index_topk 256, 4 heads, kv_lora_rank 128, rope 32), float32, random inputs, one torch thread by default.

    PYTHONPATH=. python benchmarks/dsa_prefill_chunk.py --context 131072 [--chunk 2048]

The chunk is the last `--chunk` tokens of a `--context`-token prompt. A whole prefill costs the sum over its chunks;
the indexer's share grows linearly with each chunk's context, the attention's stays flat.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sparse_kv_offload import MODEL_SHAPE  # noqa: E402

from pagedserve.attention.backend import AttentionMetadata  # noqa: E402
from pagedserve.attention.lightning_indexer import select_request_tokens  # noqa: E402
from pagedserve.attention.sparse_mla import attend_selected_prefills  # noqa: E402

BLOCK_SIZE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--num-cpu-threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.num_cpu_threads)
    torch.manual_seed(0)
    shape = MODEL_SHAPE
    index_heads, index_dim, top_k = shape["index_n_heads"], shape["index_head_dim"], shape["index_topk"]
    heads, nope, rope = shape["num_attention_heads"], shape["qk_nope_head_dim"], shape["qk_rope_head_dim"]
    rank, value_dim = shape["kv_lora_rank"], shape["v_head_dim"]
    context, chunk = args.context, args.chunk

    query = torch.randn(chunk, index_heads, index_dim)
    weights = torch.rand(chunk, index_heads) * index_heads ** -0.5
    keys = torch.randn(context, index_dim)
    start = time.perf_counter()
    selection = select_request_tokens(query, weights, keys, context - chunk, top_k, top_k, index_dim ** -0.5)
    indexer_seconds = time.perf_counter() - start

    num_blocks = -(-context // BLOCK_SIZE)
    kv_cache = torch.randn(num_blocks, BLOCK_SIZE, rank + rope)
    block_table = torch.randperm(num_blocks).to(torch.int32)[None]
    metadata = AttentionMetadata(
        num_actual_tokens=chunk, slot_mapping=torch.zeros(chunk, dtype=torch.long),
        query_start_loc=torch.tensor([0, chunk]), seq_lens=torch.tensor([context], dtype=torch.int32),
        block_table=block_table, max_query_len=chunk, max_seq_len=context, num_decodes=0, num_decode_tokens=0,
        query_start_loc_cpu=[0, chunk], seq_lens_cpu=[context], block_size=BLOCK_SIZE)
    output = torch.empty(chunk, heads, value_dim)
    start = time.perf_counter()
    attend_selected_prefills(torch.randn(chunk, heads, nope), torch.randn(chunk, heads, rope),
                             torch.empty(chunk, rank + rope), kv_cache, metadata, selection,
                             torch.randn(heads * (nope + value_dim), rank) * rank ** -0.5, rank, value_dim,
                             (nope + rope) ** -0.5, output)
    attention_seconds = time.perf_counter() - start
    print(f"context {context}, chunk {chunk}, one layer: indexer {indexer_seconds:.2f} s, sparse attention "
          f"{attention_seconds:.2f} s")


if __name__ == "__main__":
    main()
