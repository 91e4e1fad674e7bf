"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged *latent* cache, in plain PyTorch.

Cache layout (one tensor per MLA layer): [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]; a
token's row is its normalised compressed KV latent c (kv_lora_rank) followed by its rotated shared rope key
k_pe. Per-head keys and values are never stored: k_nope_h = W_UK_h c and v_h = W_UV_h c, with W_UK / W_UV
the two halves of kv_b_proj's weight viewed as [num_heads, qk_nope_head_dim + v_head_dim, kv_lora_rank].

Two ways to attend, equal in exact arithmetic:
- expansion (prefills, chunked prefills): expand each request's latent context through kv_b_proj into
  per-head K and V and run ordinary attention; the cost is paid once per prefill token;
- weight absorption (decodes): fold W_UK into the query (q_c = q_nope W_UK, per head) so the scores are
  q_c . c + q_pe . k_pe directly against the latent rows, attend over the latent itself (all heads share one
  "KV head"), and fold W_UV into the output (o_h = W_UV_h (sum_t p_t c_t)). A decode step then reads
  kv_lora_rank + rope dims per context token instead of num_heads * (2 * head_dim).

int8 cache (kv_cache_dtype="int8"): the latent rows are int8 with two float32 scales per token (c and k_pe,
kv_quantization.Int8LatentPageLayout) in the same page; the write quantizes, every read dequantizes only the
gathered blocks, and prefills always read the context back from the cache (so that a prefix-cache hit sees the
values a first computation saw).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.kv_quantization import (
    dequantize_latent,
    is_int8_kv_cache,
    kv_cache_scales,
    quantize_latent,
)
from pagedserve.platforms.sdpa_backends import cpu_attention_backends


def write_latent_to_cache(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          kv_lora_rank: int = 0) -> None:
    """latent [num_tokens, kv_lora_rank + rope] into the slots `slot_mapping` (quantized for an int8 cache,
    whose layer passes its kv_lora_rank)."""
    num_blocks, block_size, width = kv_cache.shape
    if is_int8_kv_cache(kv_cache):
        quantized, scales = quantize_latent(latent, kv_lora_rank)
        slots = slot_mapping.to(torch.long)
        index = (slots // block_size, slots % block_size)
        kv_cache.index_put_(index, quantized)
        kv_cache_scales(kv_cache).index_put_(index, scales)
        return
    if not kv_cache.is_contiguous():
        # A latent that shares its pages with other components (DSA's index keys): rows are page-strided.
        slots = slot_mapping.to(torch.long)
        kv_cache.index_put_((slots // block_size, slots % block_size), latent.to(kv_cache.dtype))
        return
    kv_cache.view(num_blocks * block_size, width).index_copy_(0, slot_mapping, latent.to(kv_cache.dtype))


def gather_latent_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, kv_lora_rank: int = 0) -> torch.Tensor:
    """kv_cache[block_ids] (int64 ids): [n, block_size, width]; an int8 cache's blocks come back dequantized
    (float32)."""
    blocks = kv_cache.index_select(0, block_ids)
    if is_int8_kv_cache(kv_cache):
        return dequantize_latent(blocks, kv_cache_scales(kv_cache).index_select(0, block_ids), kv_lora_rank)
    return blocks


def gather_latent(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, kv_lora_rank: int = 0) -> torch.Tensor:
    """One request's latent rows for positions [0, seq_len): [seq_len, kv_lora_rank + rope]."""
    _, block_size, width = kv_cache.shape
    num_used = -(-seq_len // block_size)
    blocks = gather_latent_blocks(kv_cache, block_ids[:num_used].to(torch.long), kv_lora_rank)
    return blocks.reshape(num_used * block_size, width)[:seq_len]


def _causal_mask(q_len: int, seq_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    if q_len == seq_len:
        return None
    query_positions = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    key_positions = torch.arange(seq_len, device=device)[None, :]
    mask = torch.zeros(q_len, seq_len, dtype=dtype, device=device)
    return mask.masked_fill_(key_positions > query_positions, float("-inf"))


def attend_expanded(
    q_nope: torch.Tensor,  # [q_len, H, nope]
    q_pe: torch.Tensor,  # [q_len, H, rope]
    latent: torch.Tensor,  # [seq_len, R + rope]: the request's context, its last q_len rows are the queries'
    kv_b_weight: torch.Tensor,  # [H * (nope + v), R]
    kv_lora_rank: int,
    v_head_dim: int,
    scale: float,
    mask: torch.Tensor | None = None,  # [q_len, seq_len] additive; None: causal
) -> torch.Tensor:  # [q_len, H, v]
    q_len, num_heads, nope = q_nope.shape
    seq_len = latent.shape[0]
    latent = latent.to(q_nope.dtype)
    kv = F.linear(latent[:, :kv_lora_rank], kv_b_weight).view(seq_len, num_heads, nope + v_head_dim)
    k_nope, value = kv.split([nope, v_head_dim], dim=-1)
    k_pe = latent[:, kv_lora_rank:][:, None, :].expand(seq_len, num_heads, -1)
    key = torch.cat([k_nope, k_pe], dim=-1)
    query = torch.cat([q_nope, q_pe], dim=-1)
    if mask is None:
        mask = _causal_mask(q_len, seq_len, query.dtype, query.device)
    with cpu_attention_backends(query):
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, scale=scale,
        )
    return out[0].transpose(0, 1)


def attend_absorbed_decodes(
    q_nope: torch.Tensor,  # [B, H, nope]
    q_pe: torch.Tensor,  # [B, H, rope]
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,  # [B, max_blocks]
    seq_lens: list[int],
    kv_b_weight: torch.Tensor,
    kv_lora_rank: int,
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:  # [B, H, v]
    """One new token per request, attended against the latent cache with W_UK / W_UV absorbed."""
    batch, num_heads, nope = q_nope.shape
    _, block_size, width = kv_cache.shape
    weight = kv_b_weight.view(num_heads, nope + v_head_dim, kv_lora_rank)
    w_uk, w_uv = weight[:, :nope, :], weight[:, nope:, :]
    q_latent = torch.einsum("bhd,hdr->bhr", q_nope, w_uk)
    query = torch.cat([q_latent, q_pe], dim=-1)  # [B, H, R + rope]
    max_len = max(seq_lens)
    num_span_blocks = -(-max_len // block_size)
    block_ids = block_table[:, :num_span_blocks].to(torch.long).reshape(-1)
    context = gather_latent_blocks(kv_cache, block_ids, kv_lora_rank).view(batch, num_span_blocks * block_size,
                                                                           width)
    context = context.to(query.dtype)
    lengths = torch.tensor(seq_lens, device=query.device)[:, None]
    hidden = torch.arange(num_span_blocks * block_size, device=query.device)[None, :] >= lengths
    return attend_latent_rows(query, context, hidden, kv_lora_rank, scale, w_uv)


def attend_latent_rows(
    query: torch.Tensor,  # [B, H, R + rope]: absorbed queries
    rows: torch.Tensor,  # [B, L, R + rope]: each request's latent rows, in the query's dtype
    hidden: torch.Tensor,  # [B, L] bool: rows the request does not attend (padding, unselected)
    kv_lora_rank: int,
    scale: float,
    w_uv: torch.Tensor,  # [H, v, R]
) -> torch.Tensor:  # [B, H, v]
    """Absorbed MLA attention over given latent rows: scores against the whole row, values its latent part, then
    W_UV."""
    batch = query.shape[0]
    mask = torch.zeros(batch, 1, 1, hidden.shape[1], dtype=query.dtype, device=query.device)
    mask.masked_fill_(hidden[:, None, None, :], float("-inf"))
    # The heads share the single latent "KV head": they are that head's query rows.
    with cpu_attention_backends(query):
        out_latent = F.scaled_dot_product_attention(
            query[:, None], rows[:, None], rows[:, None, :, :kv_lora_rank], attn_mask=mask, scale=scale,
        )[:, 0]  # [B, H, R]
    return torch.einsum("bhr,hvr->bhv", out_latent, w_uv)


def mla_paged_attention(
    q_nope: torch.Tensor,  # [n, H, nope]
    q_pe: torch.Tensor,  # [n, H, rope], rotated
    latent: torch.Tensor,  # [n, R + rope]: normalised latent and rotated k_pe of the new tokens
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    kv_b_weight: torch.Tensor,
    kv_lora_rank: int,
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:  # [n, H, v]
    """Write the new latents, then absorbed attention for the leading decodes and expansion for the rest."""
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != latent.shape[-1]:
        raise ValueError(f"MLA kv_cache shape {tuple(kv_cache.shape)} must be [num_blocks, block_size, "
                         f"{latent.shape[-1]}]")
    num_tokens = metadata.num_actual_tokens
    write_latent_to_cache(latent[:num_tokens], kv_cache, metadata.slot_mapping[:num_tokens], kv_lora_rank)
    num_heads = q_nope.shape[1]
    output = q_nope.new_zeros(q_nope.shape[0], num_heads, v_head_dim)
    num_decodes = metadata.num_decodes
    if num_decodes:
        output[:num_decodes] = attend_absorbed_decodes(
            q_nope[:num_decodes], q_pe[:num_decodes], kv_cache, metadata.block_table[:num_decodes],
            metadata.seq_lens_cpu[:num_decodes], kv_b_weight, kv_lora_rank, v_head_dim, scale)
    attend_expanded_requests(q_nope, q_pe, latent, kv_cache, metadata, kv_b_weight, kv_lora_rank, v_head_dim, scale,
                             output)
    return output


def attend_expanded_requests(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    kv_b_weight: torch.Tensor,
    kv_lora_rank: int,
    v_head_dim: int,
    scale: float,
    output: torch.Tensor,  # [n, H, v]: the requests' rows are written
    request_mask: Callable[[int, int, int], torch.Tensor] | None = None,
    gather_context: Callable[[int, int], torch.Tensor] | None = None,
) -> None:
    """The requests after the leading decodes (prefills, chunks), each by expansion over its context: read from the
    cache, or this step's latents when they are the whole context (and the cache is not int8).
    `request_mask(start, end, seq_len)` gives a request's additive [end - start, seq_len] mask (None: causal);
    `gather_context(request, seq_len)` reads a request's context from a cache of another layout (always used)."""
    starts = metadata.query_start_loc_cpu
    for index in range(metadata.num_decodes, metadata.num_seqs):
        start, end = starts[index], starts[index + 1]
        if end == start:
            continue
        seq_len = metadata.seq_lens_cpu[index]
        if gather_context is not None:
            context = gather_context(index, seq_len)
        elif end - start == seq_len and not is_int8_kv_cache(kv_cache):
            context = latent[start:end]  # no cached prefix: this step's latents are the whole context
        else:
            context = gather_latent(kv_cache, metadata.block_table[index], seq_len, kv_lora_rank)
        mask = request_mask(start, end, seq_len) if request_mask is not None else None
        output[start:end] = attend_expanded(q_nope[start:end], q_pe[start:end], context, kv_b_weight,
                                            kv_lora_rank, v_head_dim, scale, mask=mask)
