"""Sparse MLA (DeepSeek sparse attention): MLA in which each query token attends only to the tokens the lightning
indexer selected for it (attention/lightning_indexer.py), in plain PyTorch over the paged latent cache.

Same cache, same two forms as attention/mla_paged.py:
- decodes (absorbed): each decode gathers just its selected latent rows through the block table, [width, R + rope]
  per request, and attends them with W_UK / W_UV folded into query and output, so a step reads top_k rows per
  decode however long the context;
- prefills and chunks (gathered, attend_selected_prefills): the same absorbed form, query rows taken a bounded
  chunk at a time, each gathering its own selected rows ([chunk, width, R + rope], under PREFILL_GATHER_BYTES): a
  prefill's attention costs O(tokens x top_k), in time and memory, however long the context.
With every visible token selected (top_k >= context) both forms are exactly dense MLA (up to float rounding: the
absorbed form multiplies in another order).

The plain reference for prefills is attend_masked_prefills: the request's whole context expanded through kv_b_proj
as for dense MLA, the selection an additive [q_len, context] mask (0 at the selected positions, -inf elsewhere; the
selection is causal by construction). It is quadratic in the context and serves as the tests' oracle.

A C8 cache (kv_cache_dtype="int8", attention/sparse_int8_cache.py) takes the same forms: the write quantizes, and
every read, decode or prefill, dequantizes only the rows it gathers (always read back from the cache, so that a
prefix-cache hit sees the values a first computation saw).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from pagedserve.attention import sparse_int8_cache
from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.mla_paged import attend_expanded_requests, attend_latent_rows, write_latent_to_cache

# A prefill chunk's gathered latent rows [rows, width, R + rope] (float32 after a C8 dequantization) stay under this
# size; the attention's scores [rows, H, width] are smaller by (R + rope) / H.
PREFILL_GATHER_BYTES = 32 << 20


def selection_mask(selection: torch.Tensor, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """[q_len, seq_len] additive mask from positions [q_len, width] (-1 = none): 0 where selected, -inf elsewhere."""
    is_selected = torch.zeros(selection.shape[0], seq_len + 1, dtype=torch.bool, device=selection.device)
    # -1 lands in the extra last column, which is dropped.
    is_selected.scatter_(1, torch.where(selection < 0, seq_len, selection), True)
    mask = torch.zeros(selection.shape[0], seq_len, dtype=dtype, device=selection.device)
    return mask.masked_fill_(~is_selected[:, :seq_len], float("-inf"))


# (the step's metadata, the leading decodes' selection [num_decodes, width]) -> their latent rows
# [num_decodes, width, R + rope]: another source of the rows gather_selected_rows reads from the cache (sparse KV
# offload's resident buffers, sparse_kv_offload/layer_resident_buffers.py). Unselected entries may hold any finite
# values: attention masks them out.
DecodeRowGather = Callable[[AttentionMetadata, torch.Tensor], torch.Tensor]


def gather_selected_rows(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, R + rope]
    block_table: torch.Tensor,  # [B, max_blocks]
    selection: torch.Tensor,  # [B, width] positions, -1 = none
) -> torch.Tensor:  # [B, width, R + rope]
    """The latent rows at the selected positions, read through the block table (-1 reads position 0's row); a C8
    cache's rows come back dequantized."""
    block_size = kv_cache.shape[1]
    positions = selection.clamp(min=0)
    block_ids = block_table.to(torch.long).gather(1, positions // block_size)
    if sparse_int8_cache.is_sparse_int8_cache(kv_cache):
        return sparse_int8_cache.gather_latent_rows(kv_cache, block_ids, positions % block_size)
    return kv_cache[block_ids, positions % block_size]


def attend_selected_decodes(
    q_nope: torch.Tensor,  # [B, H, nope]
    q_pe: torch.Tensor,  # [B, H, rope]
    rows: torch.Tensor,  # [B, width, R + rope]: the selected latent rows (gather_selected_rows)
    selection: torch.Tensor,  # [B, width] positions, -1 = none
    kv_b_weight: torch.Tensor,
    kv_lora_rank: int,
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:  # [B, H, v]
    """Each query row (a decode, or a prefill token: its own row of `rows`) attended over its selected latent rows
    with W_UK / W_UV absorbed."""
    num_heads, nope = q_nope.shape[1:]
    weight = kv_b_weight.view(num_heads, nope + v_head_dim, kv_lora_rank)
    w_uk, w_uv = weight[:, :nope, :], weight[:, nope:, :]
    query = torch.cat([torch.einsum("bhd,hdr->bhr", q_nope, w_uk), q_pe], dim=-1)  # [B, H, R + rope]
    return attend_latent_rows(query, rows.to(query.dtype), selection < 0, kv_lora_rank, scale, w_uv)


def prefill_rows_per_chunk(width: int, row_width: int) -> int:
    """Query rows attended together by attend_selected_prefills: their gathered rows under PREFILL_GATHER_BYTES."""
    return max(1, PREFILL_GATHER_BYTES // (4 * max(width, 1) * row_width))


def attend_selected_prefills(
    q_nope: torch.Tensor,  # [n, H, nope]
    q_pe: torch.Tensor,  # [n, H, rope]
    latent: torch.Tensor,  # [n, R + rope] (unused: the rows are read back from the cache, this step's included)
    kv_cache: torch.Tensor,  # holding this step's latents already
    metadata: AttentionMetadata,
    selection: torch.Tensor,  # [n, width] positions, -1 = none
    kv_b_weight: torch.Tensor,
    kv_lora_rank: int,
    v_head_dim: int,
    scale: float,
    output: torch.Tensor,  # [n, H, v]: the prefill requests' rows are written
) -> None:
    """The requests after the leading decodes (prefills, chunks): each token attends only its selected rows, gathered
    through its request's block table, a bounded chunk of tokens at a time (absorbed form)."""
    width = selection.shape[1]
    rows_per_chunk = prefill_rows_per_chunk(width, latent.shape[-1])
    starts = metadata.query_start_loc_cpu
    for index in range(metadata.num_decodes, metadata.num_seqs):
        block_table = metadata.block_table[index:index + 1]
        for first in range(starts[index], starts[index + 1], rows_per_chunk):
            last = min(first + rows_per_chunk, starts[index + 1])
            chosen = selection[first:last]
            rows = gather_selected_rows(kv_cache, block_table.expand(last - first, -1), chosen)
            output[first:last] = attend_selected_decodes(q_nope[first:last], q_pe[first:last], rows, chosen,
                                                         kv_b_weight, kv_lora_rank, v_head_dim, scale)


def attend_masked_prefills(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    selection: torch.Tensor,
    kv_b_weight: torch.Tensor,
    kv_lora_rank: int,
    v_head_dim: int,
    scale: float,
    output: torch.Tensor,
) -> None:
    """attend_selected_prefills' plain reference (same arguments): each request's whole context expanded, the
    selection a dense additive mask. Quadratic in the context: for tests."""
    is_int8 = sparse_int8_cache.is_sparse_int8_cache(kv_cache)
    attend_expanded_requests(
        q_nope, q_pe, latent, kv_cache, metadata, kv_b_weight, kv_lora_rank, v_head_dim, scale, output,
        request_mask=lambda start, end, seq_len: selection_mask(selection[start:end], seq_len, q_nope.dtype),
        gather_context=(lambda index, seq_len: sparse_int8_cache.gather_latent_context(
            kv_cache, metadata.block_table[index], seq_len)) if is_int8 else None)


def attend_selected_in_sequence(
    q_nope: torch.Tensor,  # [n, H, nope]
    q_pe: torch.Tensor,  # [n, H, rope]
    latent: torch.Tensor,  # [n, R + rope]: the tokens of one causal sequence, no cache
    selection: torch.Tensor,  # [n, width] positions into `latent`, -1 = none
    kv_b_weight: torch.Tensor,
    kv_lora_rank: int,
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:  # [n, H, v]
    """The cache-free form (profiling and dummy runs): as attend_selected_prefills, the rows gathered from
    `latent`."""
    output = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], v_head_dim)
    rows_per_chunk = prefill_rows_per_chunk(selection.shape[1], latent.shape[-1])
    for first in range(0, q_nope.shape[0], rows_per_chunk):
        last = min(first + rows_per_chunk, q_nope.shape[0])
        chosen = selection[first:last]
        output[first:last] = attend_selected_decodes(q_nope[first:last], q_pe[first:last],
                                                     latent[chosen.clamp(min=0)], chosen, kv_b_weight,
                                                     kv_lora_rank, v_head_dim, scale)
    return output


def sparse_mla_attention(
    q_nope: torch.Tensor,  # [n, H, nope]
    q_pe: torch.Tensor,  # [n, H, rope], rotated
    latent: torch.Tensor,  # [n, R + rope]: normalised latent and rotated k_pe of the new tokens
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    selection: torch.Tensor,  # [n, width]: lightning_indexer.select_tokens
    kv_b_weight: torch.Tensor,
    kv_lora_rank: int,
    v_head_dim: int,
    scale: float,
    gather_decode_rows: DecodeRowGather | None = None,
) -> torch.Tensor:  # [n, H, v]
    """Write the new latents, then attend each token over its selected positions only (the decodes' rows read by
    `gather_decode_rows` when given, else from the cache)."""
    num_tokens = metadata.num_actual_tokens
    is_int8 = sparse_int8_cache.is_sparse_int8_cache(kv_cache)
    if is_int8:
        sparse_int8_cache.write_latent(latent[:num_tokens], kv_cache, metadata.slot_mapping[:num_tokens], kv_lora_rank)
    else:
        write_latent_to_cache(latent[:num_tokens], kv_cache, metadata.slot_mapping[:num_tokens], kv_lora_rank)
    output = q_nope.new_zeros(q_nope.shape[0], q_nope.shape[1], v_head_dim)
    num_decodes = metadata.num_decodes
    if num_decodes:
        decode_selection = selection[:num_decodes]
        if gather_decode_rows is None:
            rows = gather_selected_rows(kv_cache, metadata.block_table[:num_decodes], decode_selection)
        else:
            rows = gather_decode_rows(metadata, decode_selection)
        output[:num_decodes] = attend_selected_decodes(
            q_nope[:num_decodes], q_pe[:num_decodes], rows, decode_selection, kv_b_weight, kv_lora_rank, v_head_dim,
            scale)
    # Looked up in the module at call time: tests swap in attend_masked_prefills, the reference.
    attend_selected_prefills(q_nope, q_pe, latent, kv_cache, metadata, selection, kv_b_weight, kv_lora_rank,
                             v_head_dim, scale, output)
    return output


__all__ = ["DecodeRowGather", "PREFILL_GATHER_BYTES", "attend_masked_prefills", "attend_selected_decodes",
           "attend_selected_in_sequence", "attend_selected_prefills", "gather_selected_rows",
           "prefill_rows_per_chunk", "selection_mask", "sparse_mla_attention"]
