"""One prefill chunk of DeepSeek sparse attention at a given context, for extrapolating prompts too long to run: the
lightning indexer's selection for the chunk's tokens (lightning_indexer.select_request_tokens: scored against every
earlier key) and the gathered sparse attention over the selected rows (sparse_mla.attend_selected_prefills), timed
apart, for one layer of the sparse KV offload benchmark's model (sparse_kv_offload.py MODEL_SHAPE: 8 index heads of
64 dims, index_topk 256, 4 heads, kv_lora_rank 128, rope 32), float32, random inputs, one torch thread by default.

    PYTHONPATH=. python benchmarks/dsa_prefill_chunk.py --context 131072 [--chunk 2048] [--repeats 3]

The indexer runs `--repeats` times with each top-k route, interleaved: torch.topk over each whole row (the
reference, lightning_indexer.top_k_by_full_sort) and over the blocks of highest maximum (top_k_by_block_maxima, what
the engine uses); it prints the best and median of each, wall and CPU seconds of the thread (steadier than the wall
time on a machine shared with other jobs), and checks that the two selections are equal. The scoring
is the same code in both: the difference is the top-k.

The chunk is the last `--chunk` tokens of a `--context`-token prompt. A whole prefill costs the sum over its chunks;
the indexer's share grows linearly with each chunk's context, the attention's stays flat.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sparse_kv_offload import MODEL_SHAPE  # noqa: E402

from pagedserve.attention.backend import AttentionMetadata  # noqa: E402
from pagedserve.attention import lightning_indexer  # noqa: E402
from pagedserve.attention.sparse_mla import attend_selected_prefills  # noqa: E402

BLOCK_SIZE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--num-cpu-threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="indexer runs per top-k route, interleaved")
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
    routes = {"full-sort": lightning_indexer.top_k_by_full_sort,
              "block-maxima": lightning_indexer.top_k_by_block_maxima}
    fast_route = lightning_indexer.top_k_by_block_maxima
    seconds: dict[str, list[float]] = {name: [] for name in routes}
    cpu_seconds: dict[str, list[float]] = {name: [] for name in routes}
    selections = {}
    for _ in range(args.repeats):
        for name, route in routes.items():
            # _top_k_of_masked calls the module's top_k_by_block_maxima: the reference stands in for it here.
            lightning_indexer.top_k_by_block_maxima = route
            start, cpu_start = time.perf_counter(), time.thread_time()
            selections[name] = lightning_indexer.select_request_tokens(query, weights, keys, context - chunk, top_k,
                                                                       top_k, index_dim ** -0.5)
            seconds[name].append(time.perf_counter() - start)
            cpu_seconds[name].append(time.thread_time() - cpu_start)
    lightning_indexer.top_k_by_block_maxima = fast_route
    selection = selections["block-maxima"]
    same = torch.equal(selection, selections["full-sort"])
    num_blocks = -(-context // BLOCK_SIZE)
    kv_cache = torch.randn(num_blocks, BLOCK_SIZE, rank + rope)
    block_table = torch.randperm(num_blocks).to(torch.int32)[None]
    metadata = AttentionMetadata(
        num_actual_tokens=chunk, slot_mapping=torch.zeros(chunk, dtype=torch.long),
        query_start_loc=torch.tensor([0, chunk]), seq_lens=torch.tensor([context], dtype=torch.int32),
        block_table=block_table, max_query_len=chunk, max_seq_len=context, num_decodes=0, num_decode_tokens=0,
        query_start_loc_cpu=[0, chunk], seq_lens_cpu=[context], block_size=BLOCK_SIZE)
    output = torch.empty(chunk, heads, value_dim)
    start, cpu_start = time.perf_counter(), time.thread_time()
    attend_selected_prefills(torch.randn(chunk, heads, nope), torch.randn(chunk, heads, rope),
                             torch.empty(chunk, rank + rope), kv_cache, metadata, selection,
                             torch.randn(heads * (nope + value_dim), rank) * rank ** -0.5, rank, value_dim,
                             (nope + rope) ** -0.5, output)
    attention_seconds = time.perf_counter() - start
    attention_cpu_seconds = time.thread_time() - cpu_start
    indexer = ", ".join(f"{name} best {min(times):.2f} s median {statistics.median(times):.2f} s (CPU best "
                        f"{min(cpu_seconds[name]):.2f} s median {statistics.median(cpu_seconds[name]):.2f} s)"
                        for name, times in seconds.items())
    print(f"context {context}, chunk {chunk}, one layer: indexer ({args.repeats} runs each) {indexer}; equal "
          f"selections: {same}; sparse attention {attention_seconds:.2f} s (CPU {attention_cpu_seconds:.2f} s); "
          f"load average (1 min) {os.getloadavg()[0]:.2f}")
    print(top_k_alone(query, weights, keys, top_k, index_dim ** -0.5, routes))


def top_k_alone(query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, top_k: int, softmax_scale: float,
                routes: dict) -> str:
    """The top-k of the chunk's last row group alone (its scores against every earlier key, the causal tail hidden),
    each route 5 times interleaved: thread CPU milliseconds, best and median."""
    num_rows = lightning_indexer.prefill_rows_per_group(query.shape[1], keys.shape[0])
    scores = lightning_indexer.index_scores_tiled(query[-num_rows:].float(), weights[-num_rows:].float(), keys,
                                                  softmax_scale)
    hidden = torch.ones(num_rows, num_rows, dtype=torch.bool).triu_(1)
    scores[:, -num_rows:].masked_fill_(hidden, float("-inf"))
    milliseconds: dict[str, list[float]] = {name: [] for name in routes}
    for _ in range(5):
        for name, route in routes.items():
            start = time.thread_time()
            route(scores, top_k)
            milliseconds[name].append((time.thread_time() - start) * 1e3)
    return (f"top-k of one {num_rows}-row group over {keys.shape[0]} keys, thread CPU ms: " + ", ".join(
        f"{name} best {min(times):.1f} median {statistics.median(times):.1f}" for name, times in milliseconds.items()))


if __name__ == "__main__":
    main()
