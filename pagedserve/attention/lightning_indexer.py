"""The lightning indexer of DeepSeek sparse attention (DSA; DeepSeek-V3.2, GLM-5), in plain PyTorch over the paged
cache: which past tokens each query token attends to.

Per token t the indexer has `num_index_heads` query heads q[t, j] (index_head_dim each), one key k[t] shared by all
heads and per-head weights w[t, j] (the model folds num_index_heads^-0.5 into them). The score of a visible key s
(s <= t, causal) is

    I[t, s] = sum_j w[t, j] * ReLU(softmax_scale * q[t, j] . k[s])

and t attends to the `top_k` visible tokens of highest score (all of them when at most top_k are visible).

Keys live in the layer's page beside its MLA latent (component INDEX_KEY_COMPONENT, attention/kv_page_layout.py):
one row of index_head_dim values per token, under the latent's block ids, so prefix caching, preemption and chunked
prefill see the keys a first computation wrote.

Under kv_cache_dtype="int8" (C8, attention/sparse_int8_cache.py) the keys are int8 with a float32 scale per token
(`key_scale_cache`) and the queries come int8 with their scales folded into the weights; the score is computed on
the int8 values in place and the key scale multiplies it: s_q s_k ReLU(q~ . k~) = ReLU((s_q q~) . (s_k k~)).

A step's selection is one int64 tensor [num_tokens, width] of token positions within each token's request, width =
min(top_k, the step's longest context); unused entries are -1.
"""
from __future__ import annotations

import torch

from pagedserve.attention.backend import AttentionMetadata

# The page component holding the indexer's keys (KVCacheSpec.extra_components of a DSA layer).
INDEX_KEY_COMPONENT = "index_key"
# Query rows are scored in groups whose per-head score temporaries [rows, H, S] (float32) stay under this size: a
# long prompt's chunk against a long context would otherwise need gigabytes at once.
SCORE_CHUNK_BYTES = 64 << 20


def _row_groups(num_rows: int, num_heads: int, num_keys: int) -> list[tuple[int, int]]:
    rows = max(1, SCORE_CHUNK_BYTES // (4 * num_heads * max(num_keys, 1)))
    return [(start, min(start + rows, num_rows)) for start in range(0, num_rows, rows)]


def write_index_keys(keys: torch.Tensor, key_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """keys [num_tokens, index_head_dim] into `key_cache` [num_blocks, block_size, index_head_dim] (a page-strided
    view) at the flat slots `slot_mapping`."""
    block_size = key_cache.shape[1]
    slots = slot_mapping.to(torch.long)
    key_cache.index_put_((slots // block_size, slots % block_size), keys.to(key_cache.dtype))


def index_scores(query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, softmax_scale: float,
                 key_scales: torch.Tensor | None = None) -> torch.Tensor:
    """I[t, s] for query [..., T, H, D], weights [..., T, H] and keys [..., S, D]: [..., T, S], in float32.
    `key_scales` [..., S]: int8 keys' scales, multiplied into each key's score."""
    # int8 values multiply exactly in float32 (|q~ . k~| <= 127^2 * D stays below 2^24 for D <= 1040).
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2).unsqueeze(-3)) * softmax_scale
    scores = torch.relu(scores)  # [..., T, H, S]
    scores = torch.matmul(weights.float().unsqueeze(-2), scores).squeeze(-2)
    return scores if key_scales is None else scores * key_scales.unsqueeze(-2)


def top_k_positions(scores: torch.Tensor, visible: torch.Tensor, top_k: int, width: int) -> torch.Tensor:
    """The positions of the `top_k` highest `scores` [..., S] among the `visible` ones ([..., S] bool), as int64
    [..., width] (width >= min(top_k, the number visible)), -1 where fewer are visible."""
    masked = scores.masked_fill(~visible, float("-inf"))
    count = min(top_k, masked.shape[-1])
    values, positions = masked.topk(count, dim=-1)
    positions = positions.masked_fill(values == float("-inf"), -1)
    if count >= width:
        return positions[..., :width]
    padding = positions.new_full((*positions.shape[:-1], width - count), -1)
    return torch.cat([positions, padding], dim=-1)


def gather_index_keys(key_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One request's keys for positions [0, seq_len): [seq_len, *per_token] (block_ids: its block table row; the
    same for a key scale cache [num_blocks, block_size])."""
    block_size = key_cache.shape[1]
    num_used = -(-seq_len // block_size)
    blocks = key_cache.index_select(0, block_ids[:num_used].to(torch.long))
    return blocks.reshape(num_used * block_size, *key_cache.shape[2:])[:seq_len]


def select_tokens(
    query: torch.Tensor,  # [num_tokens, H, D], rotated
    weights: torch.Tensor,  # [num_tokens, H]
    key_cache: torch.Tensor,  # [num_blocks, block_size, D], holding this step's keys already
    metadata: AttentionMetadata,
    top_k: int,
    softmax_scale: float,
    key_scale_cache: torch.Tensor | None = None,  # [num_blocks, block_size] float32: int8 keys' scales (C8)
) -> torch.Tensor:  # [num_tokens, width] int64 positions, -1 padded
    """Each of the step's tokens' top-k positions (see the module docstring). The leading decodes are scored
    together against their gathered keys; every other request on its own. With `key_scale_cache` the keys are
    int8 and `query` / `weights` come from sparse_int8_cache.quantize_index_query."""
    num_tokens = metadata.num_actual_tokens
    seq_lens = metadata.seq_lens_cpu
    width = min(top_k, max(seq_lens)) if seq_lens else 0
    selection = torch.full((query.shape[0], width), -1, dtype=torch.long, device=query.device)
    if num_tokens == 0:
        return selection
    block_size = key_cache.shape[1]
    num_decodes = metadata.num_decodes
    if num_decodes:
        lengths = seq_lens[:num_decodes]
        num_span_blocks = -(-max(lengths) // block_size)
        block_ids = metadata.block_table[:num_decodes, :num_span_blocks].to(torch.long).reshape(-1)
        keys = key_cache.index_select(0, block_ids).reshape(num_decodes, num_span_blocks * block_size, -1)
        key_scales = (key_scale_cache.index_select(0, block_ids).reshape(num_decodes, -1)
                      if key_scale_cache is not None else None)
        positions = torch.arange(keys.shape[1], device=query.device)[None, :]
        visible = positions < torch.tensor(lengths, device=query.device)[:, None]
        for first, last in _row_groups(num_decodes, query.shape[1], keys.shape[1]):
            scores = index_scores(query[first:last, None], weights[first:last, None], keys[first:last],
                                  softmax_scale, key_scales[first:last] if key_scales is not None else None)[:, 0]
            selection[first:last] = top_k_positions(scores, visible[first:last], top_k, width)
    starts = metadata.query_start_loc_cpu
    for index in range(num_decodes, metadata.num_seqs):
        start, end = starts[index], starts[index + 1]
        if end == start:
            continue
        seq_len = seq_lens[index]
        keys = gather_index_keys(key_cache, metadata.block_table[index], seq_len)
        key_scales = (gather_index_keys(key_scale_cache, metadata.block_table[index], seq_len)
                      if key_scale_cache is not None else None)
        key_positions = torch.arange(seq_len, device=query.device)[None, :]
        first_position = seq_len - (end - start)
        for first, last in _row_groups(end - start, query.shape[1], seq_len):
            scores = index_scores(query[start + first:start + last], weights[start + first:start + last], keys,
                                  softmax_scale, key_scales)
            query_positions = torch.arange(first_position + first, first_position + last, device=query.device)
            visible = key_positions <= query_positions[:, None]
            selection[start + first:start + last] = top_k_positions(scores, visible, top_k, width)
    return selection


def select_tokens_in_sequence(query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, top_k: int,
                              softmax_scale: float) -> torch.Tensor:
    """The selection for the given tokens taken as one causal sequence (no cache: profiling and dummy runs)."""
    num_tokens = query.shape[0]
    scores = index_scores(query, weights, keys, softmax_scale)
    positions = torch.arange(num_tokens, device=query.device)
    visible = positions[None, :] <= positions[:, None]
    return top_k_positions(scores, visible, top_k, min(top_k, num_tokens))


__all__ = ["INDEX_KEY_COMPONENT", "gather_index_keys", "index_scores", "select_tokens", "select_tokens_in_sequence",
           "top_k_positions", "write_index_keys"]
