"""Decode context parallel (DCP): the KV history of every request split over a group of TP ranks.

vLLM's `decode_context_parallel_size`. The group is `size` consecutive TP ranks that hold the same KV heads
(replicas, QKVParallelLinear) or the same MLA latent; instead of each storing every position, group rank r stores
the positions p with p % size == r. A block id then stands for `size * block_size` positions of a request: each
rank's page of that id holds `block_size` of them, position p at page offset (p % (size * block_size)) // size.
The scheduler's KV cache manager counts blocks of `size * block_size` tokens (EngineConfig.tokens_per_block), so
the same memory per rank holds `size` times the tokens.

Attention per step, for every new query token (prefill, chunk or decode alike):
1. each rank writes only the new tokens it owns;
2. the query heads of the group are all-gathered (each rank attends every head of the group over its own
   positions; MLA gathers the W_UK-absorbed queries, since a rank holds W_UK / W_UV of its own heads only);
3. each rank computes a partial attention over its positions that the query may see (causal, sliding window)
   with its log-sum-exp, `partial_attention`;
4. one all-to-all sends each rank the partials of its own heads from every rank, merged by log-sum-exp
   (`merge_partial_attention`): exactly the softmax over the union of the positions.
Plain PyTorch throughout: the reference form, and the one path (the native decode stack runs one rank only).

Prefill context parallel (distributed/prefill_context_parallel.py) reuses all of it: the group that splits the
positions is then the PCP x DCP ranks (`ContextParallelStep.group`, rank pcp_rank * dcp + dcp_rank), the heads are
gathered over the DCP ranks only (`head_group`), and since each PCP rank runs its own run of the step's tokens, the
attention entry points first gather the step's tokens (`gather_tokens`: queries, new K/V or latents) and return
this rank's rows of the merged output (merge_over_group's all-to-all sends each rank only its rows and heads).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedserve.attention.backend import AttentionBackend, AttentionMetadata
from pagedserve.attention.mla_paged import gather_latent, write_latent_to_cache
from pagedserve.attention.torch_paged import gather_context, write_to_kv_cache
from pagedserve.distributed.parallel_state import GroupCoordinator
from pagedserve.distributed.prefill_context_parallel import TokenSplit

SCORE_CHUNK_BYTES = 64 << 20


@dataclass
class ContextParallelStep:
    """One step's view of the group: which of the step's tokens this rank stores."""

    # The ranks that split the KV positions (DCP, or PCP x DCP): position p on group rank p % world_size.
    group: GroupCoordinator
    # [num_local_tokens] int64: indices into the step's tokens of those whose position this rank owns; the
    # metadata's slot_mapping holds their slots, in the same order.
    local_token_indices: torch.Tensor
    # The ranks holding the same tokens and different heads, whose queries each rank attends (the DCP group).
    head_group: GroupCoordinator | None = None
    # Prefill context parallel: the step's tokens split over the PCP ranks (None: every rank has all of them).
    token_split: TokenSplit | None = None

    def __post_init__(self) -> None:
        if self.head_group is None:
            self.head_group = self.group

    def gather_tokens(self, tensor: torch.Tensor) -> torch.Tensor:
        """The step's rows [num_tokens, ...] of a tensor this rank holds its own rows of (itself without PCP)."""
        return tensor if self.token_split is None else self.token_split.gather(tensor)

    def num_local_rows(self, num_tokens: int) -> int:
        """This rank's rows of a step of `num_tokens` tokens (all of them without PCP)."""
        return num_tokens if self.token_split is None else self.token_split.num_local

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.world_size

    def num_local_positions(self, seq_len: int) -> int:
        """Positions in [0, seq_len) this rank stores: rank, rank + size, ..."""
        return max(0, -(-(seq_len - self.rank) // self.size))

    def local_key_positions(self, num_local: int, device: torch.device) -> torch.Tensor:
        return torch.arange(num_local, device=device) * self.size + self.rank


class DecodeContextParallel:
    """The model runner's side: this rank's place in the group and the step's local slots."""

    def __init__(self, group: GroupCoordinator, page_block_size: int, head_group: GroupCoordinator | None = None,
                 token_group: GroupCoordinator | None = None) -> None:
        """`group` splits the positions; `head_group` (default: `group`) gathers heads; `token_group` (PCP, None
        without) splits the step's tokens."""
        self.group = group
        self.page_block_size = page_block_size
        self.head_group = head_group if head_group is not None else group
        self.token_group = token_group

    @property
    def tokens_per_block(self) -> int:
        """Positions one block id covers over the group."""
        return self.group.world_size * self.page_block_size

    def local_slots(self, block_ids: np.ndarray, positions: np.ndarray,
                    device: torch.device) -> tuple[np.ndarray, ContextParallelStep]:
        """Slots (in this rank's pages) of the step tokens this rank owns, and the step's view.

        `block_ids[t]` is token t's block id (for blocks of `tokens_per_block` positions), `positions[t]` its
        position."""
        size, rank = self.group.world_size, self.group.rank
        is_local = positions % size == rank
        local_positions = positions[is_local]
        slots = block_ids[is_local].astype(np.int64) * self.page_block_size \
            + (local_positions % self.tokens_per_block) // size
        indices = torch.from_numpy(np.flatnonzero(is_local)).to(device)
        token_split = None if self.token_group is None else TokenSplit(self.token_group, len(positions))
        return slots, ContextParallelStep(self.group, indices, self.head_group, token_split)


def build_decode_context_parallel(engine_config: Any) -> DecodeContextParallel | None:
    """This rank's context-parallel view for the model runner (DCP, PCP or both), or None when neither is set."""
    parallel_config = engine_config.parallel_config
    if parallel_config.context_parallel_size == 1:
        return None
    from pagedserve.distributed.parallel_state import get_context_parallel_kv_group, get_dcp_group, get_pcp_group

    token_group = get_pcp_group() if parallel_config.prefill_context_parallel_size > 1 else None
    return DecodeContextParallel(get_context_parallel_kv_group(), engine_config.cache_config.block_size,
                                 head_group=get_dcp_group(), token_group=token_group)


def partial_attention(
    query: torch.Tensor,  # [q_len, H, D]
    key: torch.Tensor,  # [H_kv, L, D]
    value: torch.Tensor,  # [H_kv, L, Dv]
    query_positions: torch.Tensor,  # [q_len]
    key_positions: torch.Tensor,  # [L]
    scale: float,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # float32 [q_len, H, Dv], [q_len, H]
    """Softmax attention of each query over the keys it may see (key position <= query position, and within the
    sliding window), normalised over those keys, with the log-sum-exp of its scores: -inf (and a zero output)
    for a query that sees none of them. Query head h reads KV head h // (H / H_kv). Computed in float32 whatever
    the inputs' dtype: the partials are merged before anything is rounded to the model's dtype."""
    q_len, num_heads, dim = query.shape
    num_kv_heads = key.shape[0]
    queries = query.float().reshape(q_len, num_kv_heads, num_heads // num_kv_heads, dim).permute(1, 2, 0, 3)
    scores = torch.matmul(queries, key.float().transpose(-1, -2).unsqueeze(1)) * scale  # [H_kv, G, q, L]
    hidden = key_positions[None, :] > query_positions[:, None]
    if sliding_window is not None:
        hidden |= key_positions[None, :] <= query_positions[:, None] - sliding_window
    scores.masked_fill_(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H_kv, G, q]
    # A fully hidden row: -inf - -inf is NaN; its weight is zero.
    probabilities = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)
    out = torch.matmul(probabilities, value.float().unsqueeze(1))  # [H_kv, G, q, Dv]
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, -1), lse.permute(2, 0, 1).reshape(q_len, num_heads)


def merge_partial_attention(outputs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """outputs [R, n, H, D] and lses [R, n, H] (float32) of attention over R disjoint key sets -> attention over
    their union [n, H, D]: partial r weighs exp(lse_r - max lse). A row no partial saw stays zero."""
    max_lse = lses.max(dim=0).values
    weights = torch.exp(lses - max_lse.unsqueeze(0)).nan_to_num_(0.0)
    total = weights.sum(dim=0)
    merged = (weights.unsqueeze(-1) * outputs).sum(dim=0)
    return merged / total.clamp_min(torch.finfo(total.dtype).tiny).unsqueeze(-1)


def step_of(metadata: AttentionMetadata) -> ContextParallelStep:
    """The step's context-parallel view (a RuntimeError when the runner set none)."""
    step = metadata.context_parallel
    if step is None:
        raise RuntimeError("the decode_context_parallel attention path needs the step's context-parallel view "
                           "(the model runner sets it when decode_context_parallel_size > 1)")
    return step


def local_request_spans(metadata: AttentionMetadata,
                        step: ContextParallelStep) -> Iterator[tuple[int, int, int, int, int]]:
    """(request index, first query row, end row, seq_len, positions this rank holds) of each request of the step
    that has query rows here and at least one local position."""
    starts = metadata.query_start_loc_cpu
    for index, seq_len in enumerate(metadata.seq_lens_cpu):
        start, end = starts[index], starts[index + 1]
        num_local = step.num_local_positions(seq_len)
        if end > start and num_local > 0:
            yield index, start, end, seq_len, num_local


def merge_over_group(step: ContextParallelStep, out: torch.Tensor, lse: torch.Tensor, num_heads: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """The group's float32 partials (out [n, H_group, Dv], lse [n, H_group], every step token) merged for this
    rank's rows (all n without PCP, else its `token_split.num_local`) and its `num_heads` heads, in `dtype`.

    One all-to-all: group rank k = pcp_rank * dcp + dcp_rank receives from every rank just the partials of its rows
    and heads (no rank receives the others' rows, as an all-gather would send)."""
    num_tokens, num_group_heads, value_dim = out.shape
    num_head_ranks = num_group_heads // num_heads
    split = step.token_split
    num_token_ranks, num_rows = (1, num_tokens) if split is None else (split.group.world_size, split.num_local)
    padding = num_token_ranks * num_rows - num_tokens
    if padding:
        out = torch.cat([out, out.new_zeros(padding, num_group_heads, value_dim)])
        lse = torch.cat([lse, lse.new_full((padding, num_group_heads), float("-inf"))])
    # [token rank, rows, head rank, heads, ...] -> destination-major [token rank, head rank, rows, heads, ...]
    out = out.view(num_token_ranks, num_rows, num_head_ranks, num_heads, value_dim).transpose(1, 2)
    lse = lse.view(num_token_ranks, num_rows, num_head_ranks, num_heads).transpose(1, 2)
    size = step.group.world_size
    outputs = step.group.all_to_all_single(out.reshape(size * num_rows, num_heads, value_dim))
    lses = step.group.all_to_all_single(lse.reshape(size * num_rows, num_heads))
    merged = merge_partial_attention(outputs.view(size, num_rows, num_heads, value_dim),
                                     lses.view(size, num_rows, num_heads))
    return merged.to(dtype)


def _local_partials(
    queries: torch.Tensor,  # [n, H_group, D]
    metadata: AttentionMetadata,
    step: ContextParallelStep,
    value_dim: int,
    # (request index, num local positions) -> (key [H_kv, L, D], value [H_kv, L, Dv])
    read_context: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    sliding_window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, _ = queries.shape
    out = queries.new_zeros(num_tokens, num_heads, value_dim, dtype=torch.float32)
    lse = queries.new_full((num_tokens, num_heads), float("-inf"), dtype=torch.float32)
    for index, start, end, seq_len, num_local in local_request_spans(metadata, step):
        key, value = read_context(index, num_local)
        key_positions = step.local_key_positions(num_local, queries.device)
        _attend_request_rows(out, lse, queries, start, end, seq_len, key, value, key_positions, scale,
                             sliding_window)
    return out, lse


def _attend_request_rows(out: torch.Tensor, lse: torch.Tensor, queries: torch.Tensor, start: int, end: int,
                         seq_len: int, key: torch.Tensor, value: torch.Tensor, key_positions: torch.Tensor,
                         scale: float, sliding_window: int | None) -> None:
    """One request's query rows [start, end) (the last of its seq_len positions) over its local keys, into out / lse."""
    num_heads, num_local = queries.shape[1], key.shape[1]
    first_position = seq_len - (end - start)
    # Query rows in groups whose float32 scores [H, rows, L] stay under SCORE_CHUNK_BYTES (a long prompt's chunk
    # against a long context would otherwise need gigabytes at once).
    rows = max(1, SCORE_CHUNK_BYTES // (4 * num_heads * num_local))
    for first in range(start, end, rows):
        last = min(first + rows, end)
        query_positions = torch.arange(first_position + first - start, first_position + last - start,
                                       device=queries.device)
        out[first:last], lse[first:last] = partial_attention(
            queries[first:last], key, value, query_positions, key_positions, scale, sliding_window)


def _mla_partials_by_form(
    q_nope: torch.Tensor,  # [n, H, nope]: the step's tokens
    q_pe: torch.Tensor,  # [n, H, rope]
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    step: ContextParallelStep,
    kv_b_weight: torch.Tensor,  # [H * (nope + v), R]: every head this rank attends
    kv_lora_rank: int,
    v_head_dim: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # float32 [n, H, v], [n, H]
    """MLA partials when this rank holds W_UK / W_UV of every head it attends (no DCP head gather: PCP alone), each
    request in its cheaper form, as one process does: a prefill chunk expands its local latents into per-head keys
    (nope + rope values) and values (v), where the absorbed form would score 144-value rows and carry the latent;
    a decode stays absorbed (expanding the whole context for one query would cost more than it saves) and its
    latent output goes through W_UV. The merge is linear in the outputs, so partials of either form merge alike."""
    num_tokens, num_heads, nope = q_nope.shape
    weight = kv_b_weight.view(num_heads, nope + v_head_dim, kv_lora_rank)
    w_uk, w_uv = weight[:, :nope, :], weight[:, nope:, :]
    out = q_nope.new_zeros(num_tokens, num_heads, v_head_dim, dtype=torch.float32)
    lse = q_nope.new_full((num_tokens, num_heads), float("-inf"), dtype=torch.float32)
    for index, start, end, seq_len, num_local in local_request_spans(metadata, step):
        rows = gather_latent(kv_cache, metadata.block_table[index], num_local, kv_lora_rank).to(q_nope.dtype)
        key_positions = step.local_key_positions(num_local, q_nope.device)
        if end - start == 1:
            query = torch.cat([torch.einsum("nhd,hdr->nhr", q_nope[start:end], w_uk), q_pe[start:end]], dim=-1)
            query_position = torch.tensor([seq_len - 1], device=q_nope.device)
            latent_out, lse[start:end] = partial_attention(query, rows[None], rows[None, :, :kv_lora_rank],
                                                           query_position, key_positions, scale)
            out[start:end] = torch.einsum("nhr,hvr->nhv", latent_out, w_uv.float())
            continue
        expanded = (rows[:, :kv_lora_rank] @ kv_b_weight.t()).view(num_local, num_heads, nope + v_head_dim)
        rope = rows[:, None, kv_lora_rank:].expand(num_local, num_heads, rows.shape[1] - kv_lora_rank)
        key = torch.cat([expanded[..., :nope], rope], dim=-1).transpose(0, 1)  # [H, L, nope + rope]
        value = expanded[..., nope:].transpose(0, 1)  # [H, L, v]
        queries = torch.cat([q_nope[start:end], q_pe[start:end]], dim=-1)
        # Views of the request's rows: written in place.
        _attend_request_rows(out[start:end], lse[start:end], queries, 0, end - start, seq_len, key, value,
                             key_positions, scale, None)
    return out, lse


class DecodeContextParallelBackend(AttentionBackend):
    """Dense (MHA / GQA) attention with the KV positions split over the DCP group."""

    name = "decode_context_parallel"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, sliding_window: int | None = None) -> torch.Tensor:
        step = step_of(metadata)
        output = torch.zeros_like(query)  # this rank's rows
        query, key, value = step.gather_tokens(query), step.gather_tokens(key), step.gather_tokens(value)
        num_tokens = metadata.num_actual_tokens
        local = step.local_token_indices
        write_to_kv_cache(key[local], value[local], kv_cache, metadata.slot_mapping)
        queries = step.head_group.all_gather(query[:num_tokens], dim=1)

        def read_context(index: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
            return gather_context(kv_cache, metadata.block_table[index], num_local)

        out, lse = _local_partials(queries, metadata, step, query.shape[2], read_context, scale, sliding_window)
        merged = merge_over_group(step, out, lse, query.shape[1], query.dtype)
        output[:merged.shape[0]] = merged
        return output


def absorbed_group_queries(step: ContextParallelStep, q_nope: torch.Tensor, q_pe: torch.Tensor,
                           kv_b_weight: torch.Tensor, kv_lora_rank: int, v_head_dim: int,
                           num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's W_UK-absorbed queries [n, H_group, R + rope] (this rank holds W_UK / W_UV of its own heads only,
    so it absorbs its heads before the gather) and this rank's W_UV [H, v, R] for the merged output."""
    num_heads, nope = q_nope.shape[1:]
    weight = kv_b_weight.view(num_heads, nope + v_head_dim, kv_lora_rank)
    w_uk, w_uv = weight[:, :nope, :], weight[:, nope:, :]
    query = torch.cat([torch.einsum("nhd,hdr->nhr", q_nope[:num_tokens], w_uk), q_pe[:num_tokens]], dim=-1)
    return step.head_group.all_gather(query, dim=1), w_uv


def mla_context_parallel_attention(
    q_nope: torch.Tensor,  # [n, H, nope]
    q_pe: torch.Tensor,  # [n, H, rope], rotated
    latent: torch.Tensor,  # [n, R + rope]
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    kv_b_weight: torch.Tensor,  # this rank's heads: [H * (nope + v), R]
    kv_lora_rank: int,
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:  # [n, H, v]
    """MLA with the latent positions split over the DCP (or PCP x DCP) group: in the absorbed form for every token
    when the heads are gathered over DCP ranks, else each request in its cheaper form (_mla_partials_by_form)."""
    step = step_of(metadata)
    num_rows = q_nope.shape[0]  # this rank's
    q_nope, q_pe, latent = step.gather_tokens(q_nope), step.gather_tokens(q_pe), step.gather_tokens(latent)
    num_tokens = metadata.num_actual_tokens
    write_latent_to_cache(latent[:num_tokens][step.local_token_indices], kv_cache, metadata.slot_mapping,
                          kv_lora_rank)
    num_heads = q_nope.shape[1]
    if step.head_group.world_size == 1:
        out, lse = _mla_partials_by_form(q_nope[:num_tokens], q_pe[:num_tokens], kv_cache, metadata, step,
                                         kv_b_weight, kv_lora_rank, v_head_dim, scale)
        merged = merge_over_group(step, out, lse, num_heads, q_nope.dtype)  # [this rank's rows, H, v]
        output = q_nope.new_zeros(num_rows, num_heads, v_head_dim)
        output[:merged.shape[0]] = merged
        return output
    queries, w_uv = absorbed_group_queries(step, q_nope, q_pe, kv_b_weight, kv_lora_rank, v_head_dim, num_tokens)

    def read_context(index: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = gather_latent(kv_cache, metadata.block_table[index], num_local, kv_lora_rank).to(queries.dtype)
        return rows.unsqueeze(0), rows[None, :, :kv_lora_rank]

    out, lse = _local_partials(queries, metadata, step, kv_lora_rank, read_context, scale, None)
    out_latent = merge_over_group(step, out, lse, num_heads, queries.dtype)  # [this rank's rows, H, R]
    output = q_nope.new_zeros(num_rows, num_heads, v_head_dim)
    output[:out_latent.shape[0]] = torch.einsum("nhr,hvr->nhv", out_latent, w_uv)
    return output


__all__ = ["ContextParallelStep", "DecodeContextParallel", "DecodeContextParallelBackend", "absorbed_group_queries",
           "build_decode_context_parallel", "merge_partial_attention", "merge_over_group", "mla_context_parallel_attention", "partial_attention",
           "step_of"]
