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
min(top_k, the step's longest context); unused entries are -1. select_tokens gives each row in ascending order, -1s
at the end.

A prefill chunk is scored a group of query rows at a time, each group key tile by key tile (select_request_tokens):
the indexer is quadratic in the context in time, as the method is, but holds at most a group's [rows, context]
scores, never a [chunk, context] tensor. A long row's top-k runs over the keys of its top_k + 1 blocks of highest
maximum (top_k_by_block_maxima), the same set as torch.topk over the whole row (top_k_by_full_sort, the reference),
ties included.
"""
from __future__ import annotations

import torch

from pagedserve.attention.backend import AttentionMetadata

# The page component holding the indexer's keys (KVCacheSpec.extra_components of a DSA layer).
INDEX_KEY_COMPONENT = "index_key"
# Decode rows are scored in groups whose per-head score temporaries [rows, H, S] (float32) stay under this size: a
# batch of decodes against long contexts would otherwise need gigabytes at once.
SCORE_CHUNK_BYTES = 64 << 20
# A prefill's rows are scored tile by tile, [rows, H, keys] per tile under SCORE_TILE_BYTES (float32), so that the
# per-head temporaries (product, ReLU, weighted sum over the heads) stay in the core's cache: the pass is memory-bound
# on them otherwise (64 MiB temporaries scored ~5x slower, one thread on a 2-vCPU Xeon VM). A group's full score rows
# [rows, keys] stay under SCORE_CHUNK_BYTES, the only place a prompt's scores exist at once.
SCORE_TILE_BYTES = 8 << 20
KEY_TILE = 2048
# top_k_by_block_maxima: keys per block (32 measured best at 131k keys, top 256, one core: the blocks' maxima, their
# topk and the candidates' topk balance), and the least keys per chosen one for it: shorter rows go straight to topk
# (128-row groups of indexer scores, top 256, thread CPU ms: 32k keys 28 topk vs 31-38 blocks, 64k 38 vs 28, 128k
# 72 vs 44).
SELECTION_BLOCK = 32
BLOCK_SELECTION_MIN_KEYS_PER_CHOICE = 192


def _row_groups(num_rows: int, num_heads: int, num_keys: int) -> list[tuple[int, int]]:
    rows = max(1, SCORE_CHUNK_BYTES // (4 * num_heads * max(num_keys, 1)))
    return [(start, min(start + rows, num_rows)) for start in range(0, num_rows, rows)]


def prefill_rows_per_group(num_heads: int, num_keys: int) -> int:
    """Query rows scored together by select_request_tokens: one key tile's temporaries under SCORE_TILE_BYTES and the
    group's score rows under SCORE_CHUNK_BYTES."""
    key_tile = max(1, min(KEY_TILE, num_keys))
    by_tile = SCORE_TILE_BYTES // (4 * num_heads * key_tile)
    by_rows = SCORE_CHUNK_BYTES // (4 * max(num_keys, 1))
    return max(1, min(by_tile, by_rows))


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
    [..., width] (width >= min(top_k, the number visible)) in ascending order, -1 padded at the end where fewer are
    visible. The order is canonical (it does not depend on how topk orders its results, nor on how the rows were
    grouped), and ascending positions make the attention's row gather walk the cache forwards."""
    return _top_k_of_masked(scores.masked_fill(~visible, float("-inf")), top_k, width)


def _top_k_of_masked(masked: torch.Tensor, top_k: int, width: int) -> torch.Tensor:
    """top_k_positions of scores whose hidden entries are -inf already."""
    num_keys = masked.shape[-1]
    count = min(top_k, num_keys)
    values, positions = top_k_by_block_maxima(masked, count)
    is_chosen = values != float("-inf")
    if num_keys <= 4 * count:
        # Ascending through a membership mask read back row by row (nonzero walks it in row-major order): cheaper
        # than sorting when the keys are few against top_k.
        flat_chosen = torch.zeros_like(masked, dtype=torch.bool).scatter_(-1, positions, is_chosen)
        flat_chosen = flat_chosen.reshape(-1, num_keys)
        rows, chosen_positions = flat_chosen.nonzero(as_tuple=True)
        counts = flat_chosen.sum(dim=-1)
        rank = torch.arange(rows.shape[0], device=rows.device) - (counts.cumsum(0) - counts)[rows]
        positions = positions.new_full((flat_chosen.shape[0], count), -1)
        positions[rows, rank] = chosen_positions
        positions = positions.view(*masked.shape[:-1], count)
    else:
        # Many keys: sorting the count chosen positions beats a pass over all of them. Unchosen (-1) entries sort
        # last as "past the end".
        positions = positions.masked_fill(~is_chosen, num_keys).sort(dim=-1).values
        positions = positions.masked_fill_(positions == num_keys, -1)
    if count >= width:
        return positions[..., :width]
    padding = positions.new_full((*positions.shape[:-1], width - count), -1)
    return torch.cat([positions, padding], dim=-1)


def top_k_by_block_maxima(masked: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same (values, positions) sets as `masked.topk(count, dim=-1, sorted=False)` (in another order) for 2-D
    `masked` [rows, keys], cheaper when the keys are many against `count` (a long prefill's rows).

    torch.topk walks each whole row with a heap (measured 64 CPU ms for 128 rows of 131k keys, ~15% of scoring them).
    Instead each row's keys are cut into blocks of SELECTION_BLOCK, the count + 1 blocks of highest
    maximum are kept (with the row's tail past the last whole block) and topk runs over their keys alone.

    Exactness: let v be the count-th largest candidate and m the lowest maximum among the kept blocks. Every block
    left out has a maximum <= m, so where m < v no key left out reaches v and the candidates hold every key >= v;
    where moreover exactly `count` candidates are >= v there is no choice to make, and the set is topk's. Otherwise
    (m = v, possible only with equal scores: a tie at the boundary, which ReLU's zeros make possible, and on which
    torch.topk's choice is its own, undocumented one; a NaN, which topk ranks highest; a row with fewer than `count`
    finite scores) the row falls back to topk over its whole length: the result equals topk's in every case, ties
    included. top_k_by_full_sort is the plain reference."""
    if (masked.dim() != 2 or masked.shape[0] == 0
            or masked.shape[1] < BLOCK_SELECTION_MIN_KEYS_PER_CHOICE * count):
        return masked.topk(count, dim=-1, sorted=False)
    num_rows, num_keys = masked.shape
    num_blocks = num_keys // SELECTION_BLOCK
    num_kept = count + 1
    if num_blocks < num_kept:
        return masked.topk(count, dim=-1, sorted=False)
    whole = masked[:, :num_blocks * SELECTION_BLOCK].unflatten(-1, (num_blocks, SELECTION_BLOCK))
    kept_maxima, kept_blocks = whole.amax(dim=-1).topk(num_kept, dim=-1, sorted=False)
    offsets = torch.arange(SELECTION_BLOCK, device=masked.device)
    candidate_positions = (kept_blocks.unsqueeze(-1) * SELECTION_BLOCK + offsets).flatten(1)
    tail = torch.arange(num_blocks * SELECTION_BLOCK, num_keys, device=masked.device)
    candidate_positions = torch.cat([candidate_positions, tail.expand(num_rows, -1)], dim=-1)
    candidates = masked.gather(-1, candidate_positions)
    values, chosen = candidates.topk(count, dim=-1, sorted=False)
    positions = candidate_positions.gather(-1, chosen)
    boundary = values.amin(dim=-1, keepdim=True)
    is_exact = ((kept_maxima.amin(dim=-1, keepdim=True) < boundary).squeeze(-1)
                & ((candidates >= boundary).sum(dim=-1) == count) & ~values.isnan().any(dim=-1))
    if not bool(is_exact.all()):
        redo = (~is_exact).nonzero().squeeze(-1)
        values[redo], positions[redo] = masked[redo].topk(count, dim=-1, sorted=False)
    return values, positions


def top_k_by_full_sort(masked: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain reference of top_k_by_block_maxima: torch.topk over each whole row."""
    return masked.topk(count, dim=-1, sorted=False)


def index_scores_tiled(query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, softmax_scale: float,
                       key_scales: torch.Tensor | None = None) -> torch.Tensor:
    """index_scores for query [T, H, D], weights [T, H] and keys [S, D] (float32 already) and a positive
    `softmax_scale`, computed KEY_TILE keys at a time (the caller keeps T small: prefill_rows_per_group): [T, S]
    float32."""
    num_rows, num_heads, head_dim = query.shape
    num_keys = keys.shape[0]
    scores = query.new_empty(num_rows, num_keys)
    flat_query = query.reshape(num_rows * num_heads, head_dim)
    # ReLU(s x) = s ReLU(x) for the positive softmax scale s: folded into the weights, it saves a pass over each
    # tile's products (equal to index_scores up to float rounding).
    row_weights = (weights * softmax_scale).unsqueeze(1)  # [T, 1, H]
    for first in range(0, num_keys, KEY_TILE):
        last = min(first + KEY_TILE, num_keys)
        products = torch.mm(flat_query, keys[first:last].t()).view(num_rows, num_heads, last - first)
        torch.bmm(row_weights, products.relu_(), out=scores[:, first:last].unsqueeze(1))
    return scores if key_scales is None else scores.mul_(key_scales)


def select_request_tokens(
    query: torch.Tensor,  # [q, H, D] one request's rows, in position order (C8: int8, quantize_index_query)
    weights: torch.Tensor,  # [q, H]
    keys: torch.Tensor,  # [S, D]: the request's keys for positions [0, S), the rows' own included
    first_position: int,  # the first row's position (S - q for a chunk that ends the known tokens)
    top_k: int,
    width: int,
    softmax_scale: float,
    key_scales: torch.Tensor | None = None,  # [S] float32: C8 keys' scales
) -> torch.Tensor:  # [q, width] int64 positions, ascending, -1 padded
    """One request's consecutive query rows' top-k positions (causal), scored in row groups and key tiles: no score
    tensor larger than a group's rows [rows, S] (prefill_rows_per_group) ever exists. A row at a position below
    top_k sees at most top_k tokens and selects them all unscored."""
    num_rows = query.shape[0]
    device = query.device
    selection = torch.full((num_rows, width), -1, dtype=torch.long, device=device)
    # Rows that see at most top_k tokens take all of them, in ascending order as top_k_positions gives.
    num_unscored = min(num_rows, max(0, top_k - first_position))
    if num_unscored:
        positions = torch.arange(width, device=device)
        row_positions = torch.arange(first_position, first_position + num_unscored, device=device)
        selection[:num_unscored] = positions.masked_fill(positions[None, :] > row_positions[:, None], -1)
    if num_unscored == num_rows:
        return selection
    # int8 values multiply exactly in float32 (index_scores); converted once, not once per group.
    keys = keys.float()
    query = query.float()
    weights = weights.float()
    rows_per_group = prefill_rows_per_group(query.shape[1], keys.shape[0])
    for first in range(num_unscored, num_rows, rows_per_group):
        last = min(first + rows_per_group, num_rows)
        # Keys after the group's last row are visible to none of its rows.
        num_visible = first_position + last
        scores = index_scores_tiled(query[first:last], weights[first:last], keys[:num_visible], softmax_scale,
                                    key_scales[:num_visible] if key_scales is not None else None)
        # Causal: only the group's own positions (the last `last - first` keys) can follow one of its rows; row i
        # hides the keys after its own position, in place.
        hidden = torch.ones(last - first, last - first, dtype=torch.bool, device=device).triu_(1)
        scores[:, first_position + first:].masked_fill_(hidden, float("-inf"))
        selection[first:last] = _top_k_of_masked(scores, top_k, width)
    return selection


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
        selection[start:end] = select_request_tokens(query[start:end], weights[start:end], keys,
                                                     seq_len - (end - start), top_k, width, softmax_scale,
                                                     key_scales)
    return selection


def select_tokens_in_sequence(query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, top_k: int,
                              softmax_scale: float) -> torch.Tensor:
    """The selection for the given tokens taken as one causal sequence (no cache: profiling and dummy runs)."""
    num_tokens = query.shape[0]
    return select_request_tokens(query, weights, keys, 0, top_k, min(top_k, num_tokens), softmax_scale)


__all__ = ["INDEX_KEY_COMPONENT", "gather_index_keys", "index_scores", "index_scores_tiled", "prefill_rows_per_group",
           "select_request_tokens", "select_tokens", "select_tokens_in_sequence", "top_k_by_full_sort",
           "top_k_by_block_maxima", "top_k_positions", "write_index_keys"]
