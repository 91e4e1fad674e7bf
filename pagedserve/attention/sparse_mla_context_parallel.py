"""DeepSeek sparse attention (DSA) under decode context parallel (attention/decode_context_parallel.py).

Each rank of the DCP group stores the latents and index keys of its positions (p on group rank p % size). A token's
top-k is the top-k of the union of the ranks' local top-k candidates: each rank scores the token's index query
against its own keys, keeps its best `width` (score, global position) pairs, the pairs are all-gathered and the
top `width` of them is the selection, the same on every rank and the one a single process makes. Each rank then
gathers only the selected positions it holds (at most `width` latent rows per token, dequantized only those for
C8 pages), attends them in the absorbed form, and the partials merge by log-sum-exp as for dense MLA.
"""
from __future__ import annotations

import torch

from pagedserve.attention import sparse_int8_cache
from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.decode_context_parallel import (SCORE_CHUNK_BYTES, absorbed_group_queries,
                                                          local_request_spans, merge_over_group, step_of)
from pagedserve.attention.lightning_indexer import gather_index_keys, index_scores
from pagedserve.attention.mla_paged import write_latent_to_cache
from pagedserve.attention.sparse_mla import gather_selected_rows


def dcp_select_tokens(
    query: torch.Tensor,  # [num_tokens, H, D] index queries (C8: rotated int8, from quantize_index_query)
    weights: torch.Tensor,  # [num_tokens, H]
    key_cache: torch.Tensor,  # [num_blocks, block_size, D]: this rank's positions' keys
    metadata: AttentionMetadata,
    top_k: int,
    softmax_scale: float,
    key_scale_cache: torch.Tensor | None = None,  # C8: [num_blocks, block_size] float32
) -> torch.Tensor:  # [num_tokens, width] int64 global positions, -1 padded
    """The lightning indexer's selection (attention/lightning_indexer.select_tokens) with the keys split over the
    DCP group."""
    step = step_of(metadata)
    num_tokens = metadata.num_actual_tokens
    seq_lens = metadata.seq_lens_cpu
    width = min(top_k, max(seq_lens)) if seq_lens else 0
    values = torch.full((num_tokens, width), float("-inf"), dtype=torch.float32, device=query.device)
    positions = torch.full((num_tokens, width), -1, dtype=torch.long, device=query.device)
    for index, start, end, seq_len, num_local in local_request_spans(metadata, step):
        block_ids = metadata.block_table[index]
        keys = gather_index_keys(key_cache, block_ids, num_local)
        scales = None if key_scale_cache is None else gather_index_keys(key_scale_cache.unsqueeze(-1), block_ids,
                                                                        num_local)[:, 0]
        key_positions = step.local_key_positions(num_local, query.device)
        count = min(width, num_local)
        rows = max(1, SCORE_CHUNK_BYTES // (4 * query.shape[1] * num_local))
        for first in range(start, end, rows):
            last = min(first + rows, end)
            scores = index_scores(query[first:last], weights[first:last], keys, softmax_scale, scales)
            query_positions = torch.arange(seq_len - (end - first), seq_len - (end - last), device=query.device)
            scores = scores.masked_fill(key_positions[None, :] > query_positions[:, None], float("-inf"))
            top_values, top_indices = scores.topk(count, dim=-1)
            values[first:last, :count] = top_values
            positions[first:last, :count] = key_positions[top_indices]
    all_values = step.group.all_gather(values, dim=1)  # [n, size * width]
    all_positions = step.group.all_gather(positions, dim=1)
    top_values, top_indices = all_values.topk(width, dim=-1)
    selection = torch.full((query.shape[0], width), -1, dtype=torch.long, device=query.device)
    selection[:num_tokens] = all_positions.gather(1, top_indices).masked_fill_(top_values == float("-inf"), -1)
    return selection


def _partial_over_rows(
    queries: torch.Tensor,  # [q, H, C] absorbed queries
    rows: torch.Tensor,  # [q, W, C] each query's own latent rows
    hidden: torch.Tensor,  # [q, W] bool: rows a query does not attend
    kv_lora_rank: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # float32 [q, H, R], [q, H]
    """Each query's softmax over its own rows (values: their latent part) and its log-sum-exp (-inf: no row)."""
    scores = torch.einsum("qhc,qwc->qhw", queries.float(), rows.float()) * scale
    scores.masked_fill_(hidden[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probabilities = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)
    return torch.einsum("qhw,qwr->qhr", probabilities, rows[..., :kv_lora_rank].float()), lse


def sparse_mla_context_parallel_attention(
    q_nope: torch.Tensor,  # [n, H, nope]
    q_pe: torch.Tensor,  # [n, H, rope], rotated
    latent: torch.Tensor,  # [n, R + rope]
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    selection: torch.Tensor,  # [n, width] global positions (dcp_select_tokens), -1 = none
    kv_b_weight: torch.Tensor,  # this rank's heads: [H * (nope + v), R]
    kv_lora_rank: int,
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:  # [n, H, v]
    """Write this rank's new latents, then attend every token over the selected positions this rank holds; the
    inputs are the step's tokens (gathered under PCP), the output this rank's rows of them."""
    step = step_of(metadata)
    num_tokens = metadata.num_actual_tokens
    local_latent = latent[:num_tokens][step.local_token_indices]
    if sparse_int8_cache.is_sparse_int8_cache(kv_cache):
        sparse_int8_cache.write_latent(local_latent, kv_cache, metadata.slot_mapping, kv_lora_rank)
    else:
        write_latent_to_cache(local_latent, kv_cache, metadata.slot_mapping, kv_lora_rank)
    num_heads = q_nope.shape[1]
    queries, w_uv = absorbed_group_queries(step, q_nope, q_pe, kv_b_weight, kv_lora_rank, v_head_dim, num_tokens)
    chosen = selection[:num_tokens]
    is_local = (chosen >= 0) & (chosen % step.size == step.rank)
    local_index = torch.where(is_local, chosen // step.size, -1)  # index among this rank's positions
    # Each token's rows through its request's block table (gather_selected_rows reads -1 as row 0, masked below).
    # The token -> request map depends on the step only: the first layer builds it, the others reuse it.
    token_requests = metadata.backend_cache.get("token_requests")
    if token_requests is None:
        token_requests = torch.repeat_interleave(torch.arange(metadata.num_seqs, device=chosen.device),
                                                 torch.diff(metadata.query_start_loc.to(torch.long)))
        metadata.backend_cache["token_requests"] = token_requests
    out = queries.new_zeros(num_tokens, queries.shape[1], kv_lora_rank, dtype=torch.float32)
    lse = queries.new_full((num_tokens, queries.shape[1]), float("-inf"), dtype=torch.float32)
    rows_per_group = max(1, SCORE_CHUNK_BYTES // (4 * max(chosen.shape[1], 1) * queries.shape[2]))
    for first in range(0, num_tokens, rows_per_group):
        last = min(first + rows_per_group, num_tokens)
        rows = gather_selected_rows(kv_cache, metadata.block_table[token_requests[first:last]],
                                    local_index[first:last])
        out[first:last], lse[first:last] = _partial_over_rows(queries[first:last], rows, ~is_local[first:last],
                                                              kv_lora_rank, scale)
    out_latent = merge_over_group(step, out, lse, num_heads, queries.dtype)  # [this rank's rows, H, R]
    output = q_nope.new_zeros(step.num_local_rows(q_nope.shape[0]), num_heads, v_head_dim)
    output[:out_latent.shape[0]] = torch.einsum("nhr,hvr->nhv", out_latent, w_uv)
    return output


__all__ = ["dcp_select_tokens", "sparse_mla_context_parallel_attention"]
