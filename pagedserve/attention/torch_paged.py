"""The portable paged-attention backend in plain PyTorch: the CPU path and the oracle for other backends.

Per step it (1) scatters the new tokens' K/V into the paged cache at `slot_mapping` (the `_write_kv` hook),
then (2) attends every new query token to its request's context read back from the request's blocks.

Masking semantics (shared by every backend):
- causal within a request: the i-th of a request's q_len new tokens sits at absolute position
  p = seq_len - q_len + i and sees context positions <= p;
- sliding window w (HF Mistral/Qwen2 `sliding_window_overlay`): position p additionally sees only
  positions > p - w, i.e. a window of w tokens including itself;
- GQA: query head h reads KV head h // (num_heads // num_kv_heads) (HF `repeat_kv` order).

Fast path: the `num_decodes` single-token requests placed first are handled together. They are sorted
by context length and cut into chunks whose gathered K/V stays under DECODE_CHUNK_BYTES (bounding both
the padding waste and the size of the temporaries); each chunk gathers its blocks through the block table into a
dense [batch, kv_heads, length, head_dim] view and runs one SDPA call with a padding mask. The query
heads that share a KV head are laid out as that head's "query rows", so GQA needs no K/V expansion.
The remaining requests (prefill chunks, multi-token steps) go through one SDPA call each.
No device->host syncs: lengths come from the metadata's host lists.

An int8 cache (kv_cache_dtype="int8", attention/kv_quantization.py) takes the same paths: the write quantizes per
token and KV head, and every read dequantizes just the gathered blocks (never the whole cache). Prefills then
always attend over the cache's (dequantized) K/V, also without a cached prefix, so a prefix-cache hit or a
recompute after preemption sees the very values a first computation saw.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.attention.backend import AttentionBackend, AttentionMetadata
from pagedserve.attention.kv_quantization import gather_dequantized_blocks, is_int8_kv_cache, write_to_int8_kv_cache
from pagedserve.platforms.sdpa_backends import cpu_attention_backends

# Decode requests are attended in chunks whose gathered K/V (padded to the chunk's longest context) stays
# under this many bytes. Measured on the CPU (benchmarks/attention_micro.py): small chunks win because
# their gathered K/V is still in cache when SDPA reads it and their temporaries are recycled by the
# allocator instead of being fresh pages to fault in; below ~1 MB per-call overhead takes over.
DECODE_CHUNK_BYTES = 2 << 20


def write_to_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatters K/V rows [num_tokens, num_kv_heads, head_dim] into the cache slots `slot_mapping` (quantizing
    them for an int8 cache)."""
    if is_int8_kv_cache(kv_cache):
        write_to_int8_kv_cache(key, value, kv_cache, slot_mapping)
        return
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat_cache = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat_cache[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat_cache[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """kv_cache[:, block_ids] as [2, len(block_ids), block_size, H_kv, D], with int64 ids.

    Gathering rows of a [2, num_blocks, block_size * H_kv * D] view is ~3x faster on the CPU in float32
    than index_select over the 5-D cache (and never slower in bf16); both beat advanced indexing.
    An int8 cache's blocks come back dequantized, in float32.
    """
    if is_int8_kv_cache(kv_cache):
        return gather_dequantized_blocks(kv_cache, block_ids)
    num_blocks = kv_cache.shape[1]
    rows = kv_cache.view(2, num_blocks, -1).index_select(1, block_ids)
    return rows.view(2, block_ids.numel(), *kv_cache.shape[2:])


def gather_context(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, first_block: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reads one request's tokens from position `first_block * block_size` up to `seq_len`:
    K and V as [num_kv_heads, seq_len - first_block * block_size, head_dim]."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_used_blocks = (seq_len + block_size - 1) // block_size - first_block
    used_block_ids = block_ids[first_block:first_block + num_used_blocks].to(torch.long)
    blocks = gather_blocks(kv_cache, used_block_ids)  # [2, n, block_size, H_kv, D]
    context = blocks.reshape(2, num_used_blocks * block_size, num_kv_heads, head_dim)
    context = context[:, :seq_len - first_block * block_size].transpose(1, 2)  # [2, H_kv, length, D]
    return context[0], context[1]


def first_visible_block(first_query_position: int, sliding_window: int | None, block_size: int) -> int:
    """The first block holding a position that the query at `first_query_position` (the earliest of its
    request in this step) can see; earlier blocks need not be read at all."""
    if sliding_window is None:
        return 0
    return max(0, first_query_position - sliding_window + 1) // block_size


def validate_inputs(query: torch.Tensor, key: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                    sliding_window: int | None) -> None:
    """ValueError naming the field when the step's tensors and metadata do not fit together (shared by the
    backends built on this one)."""
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError(f"query/key must be [num_tokens, heads, head_dim], got {tuple(query.shape)} "
                         f"and {tuple(key.shape)}")
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3] != num_kv_heads \
            or kv_cache.shape[4] != query.shape[2]:
        raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)} must be [2, num_blocks, block_size, "
                         f"{num_kv_heads}, {query.shape[2]}]")
    if kv_cache.shape[2] != metadata.block_size:
        raise ValueError(f"metadata.block_size={metadata.block_size} must equal the cache's block size "
                         f"{kv_cache.shape[2]}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be None or >= 1")
    starts = metadata.query_start_loc_cpu
    if not 0 <= metadata.num_decodes <= metadata.num_seqs or starts[metadata.num_decodes] != metadata.num_decodes:
        raise ValueError(f"metadata.num_decodes={metadata.num_decodes} must count leading requests of exactly "
                         f"one new token each (query_start_loc_cpu={starts[:metadata.num_decodes + 1]})")
    if metadata.num_actual_tokens > query.shape[0]:
        raise ValueError(f"metadata.num_actual_tokens={metadata.num_actual_tokens} must be <= the number "
                         f"of query rows {query.shape[0]}")


def _request_mask(
    q_len: int, seq_len: int, first_key_position: int, sliding_window: int | None, dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """[q_len, seq_len - first_key_position] additive mask (0 = attend, -inf = hidden) for a request whose
    keys start at `first_key_position`, or None when plain `is_causal` covers it.

    Additive float rather than boolean: the CPU flash-attention kernel is markedly faster with it.
    """
    if q_len == seq_len and sliding_window is None:
        return None
    query_positions = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    key_positions = torch.arange(first_key_position, seq_len, device=device)[None, :]
    hidden = key_positions > query_positions
    if sliding_window is not None:
        hidden |= key_positions <= query_positions - sliding_window
    mask = torch.zeros(q_len, seq_len - first_key_position, dtype=dtype, device=device)
    return mask.masked_fill_(hidden, float("-inf"))


def _attend_request(
    query: torch.Tensor,  # [q_len, H, D]
    key: torch.Tensor,  # [H_kv, seq_len - first_key_position, D]
    value: torch.Tensor,  # [H_kv, seq_len - first_key_position, D]
    seq_len: int,
    first_key_position: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [q_len, H, D]
    q_len, num_heads, _ = query.shape
    mask = _request_mask(q_len, seq_len, first_key_position, sliding_window, query.dtype, query.device)
    # 4-D inputs: with 3-D ones the CPU dispatcher silently takes the slow math path.
    with cpu_attention_backends(query):
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None], key[None].to(query.dtype), value[None].to(query.dtype), attn_mask=mask,
            is_causal=mask is None, scale=scale, enable_gqa=num_heads != key.shape[0],
        )
    return out[0].transpose(0, 1)


def reference_paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The simple form: write K/V, then one SDPA call per request over its gathered context.

    Kept as the readable oracle for the batched backend and for other backends' tests.
    """
    validate_inputs(query, key, kv_cache, metadata, sliding_window)
    num_tokens = metadata.num_actual_tokens
    write_to_kv_cache(key[:num_tokens], value[:num_tokens], kv_cache, metadata.slot_mapping[:num_tokens])
    output = torch.zeros_like(query)
    starts = metadata.query_start_loc_cpu
    for index, seq_len in enumerate(metadata.seq_lens_cpu):
        start, end = starts[index], starts[index + 1]
        if end == start:
            continue
        context_key, context_value = gather_context(kv_cache, metadata.block_table[index], seq_len)
        output[start:end] = _attend_request(
            query[start:end], context_key, context_value, seq_len, 0, scale, sliding_window
        )
    return output


def _decode_chunks(seq_lens: list[int], max_chunk_tokens: int) -> list[list[int]]:
    """Splits request indices into chunks of similar context length, longest first, each holding at most
    `max_chunk_tokens` once padded to its longest member (a single longer request forms its own chunk).

    Sorting by length keeps the padding small; the token bound keeps the chunk's temporaries small.
    """
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__, reverse=True)
    chunks: list[list[int]] = []
    current: list[int] = []
    for index in order:
        if current and seq_lens[current[0]] * (len(current) + 1) > max_chunk_tokens:
            chunks.append(current)
            current = []
        current.append(index)
    if current:
        chunks.append(current)
    return chunks


@dataclass
class _DecodeChunk:
    """One chunk of decodes sharing a padded context length: what every layer needs to attend it."""

    start: int  # rows [start, end) of the length-sorted decodes
    end: int
    block_ids: torch.Tensor  # [(end - start) * num_span_blocks] int64, flat
    padded_len: int
    mask: torch.Tensor  # [end - start, 1, 1, padded_len] additive float mask


@dataclass
class _DecodePlan:
    order: torch.Tensor  # decode rows in chunk order (longest contexts first)
    chunks: list[_DecodeChunk]


def _plan_decodes(metadata: AttentionMetadata, sliding_window: int | None, bytes_per_token: int,
                  dtype: torch.dtype, device: torch.device) -> _DecodePlan:
    """Sort decodes by visible context length, cut them into chunks, and build each chunk's block ids and
    mask. The plan depends on the step's metadata only, so one plan serves every layer of the step."""
    num_decodes = metadata.num_decodes
    block_size = metadata.block_size
    seq_lens = metadata.seq_lens_cpu[:num_decodes]
    # With a sliding window only the blocks from the first visible one on are read.
    first_blocks = [first_visible_block(n - 1, sliding_window, block_size) for n in seq_lens]
    visible_lens = [n - first * block_size for n, first in zip(seq_lens, first_blocks)]
    index_chunks = _decode_chunks(visible_lens, max(1, DECODE_CHUNK_BYTES // bytes_per_token))
    order = [index for chunk in index_chunks for index in chunk]
    order_tensor = torch.tensor(order, dtype=torch.long, device=device)
    block_table = metadata.block_table.to(device).index_select(0, order_tensor).to(torch.long)
    sorted_seq_lens = torch.tensor([seq_lens[i] for i in order], dtype=torch.long, device=device)
    sorted_first_blocks = torch.tensor([first_blocks[i] for i in order], dtype=torch.long, device=device)
    chunks = []
    start = 0
    for index_chunk in index_chunks:
        end = start + len(index_chunk)
        num_span_blocks = (visible_lens[index_chunk[0]] + block_size - 1) // block_size
        padded_len = num_span_blocks * block_size
        span = torch.arange(num_span_blocks, device=device)
        key_positions = torch.arange(padded_len, device=device)[None, :]
        if sliding_window is None:
            block_ids = block_table[start:end, :num_span_blocks]
        else:
            first = sorted_first_blocks[start:end]
            # Past the end of a row's table the index is clamped; those slots lie beyond seq_len (masked).
            table_indices = (first[:, None] + span[None, :]).clamp_(max=block_table.shape[1] - 1)
            block_ids = block_table[start:end].gather(1, table_indices)
            key_positions = key_positions + (first * block_size)[:, None]
        last_positions = (sorted_seq_lens[start:end] - 1)[:, None]
        hidden = key_positions > last_positions
        if sliding_window is not None:
            hidden |= key_positions <= last_positions - sliding_window
        # An additive float mask: the CPU SDPA kernel is markedly slower with a boolean one.
        mask = torch.zeros(end - start, 1, 1, padded_len, dtype=dtype, device=device)
        mask.masked_fill_(hidden[:, None, None, :], float("-inf"))
        chunks.append(_DecodeChunk(start, end, block_ids.reshape(-1), padded_len, mask))
        start = end
    return _DecodePlan(order_tensor, chunks)


def _attend_decode_chunk(
    query: torch.Tensor,  # [B, H, D]
    kv_cache: torch.Tensor,
    chunk: _DecodeChunk,
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    batch, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    # index_select with flat int64 ids is several times faster on the CPU than advanced indexing with a
    # 2-D int32 table. [2, B*n, block_size, H_kv, D] -> [2, B, H_kv, padded_len, D] (a strided view):
    # padded rows read the null block or stale slots and are masked out.
    context = gather_blocks(kv_cache, chunk.block_ids)
    context = context.view(2, batch, chunk.padded_len, num_kv_heads, head_dim).transpose(2, 3)
    if context.dtype != query.dtype:
        context = context.to(query.dtype)
    # The `group` query heads sharing one KV head become that head's query rows: no K/V expansion.
    grouped_query = query.view(batch, num_kv_heads, group, head_dim)
    with cpu_attention_backends(query):
        out = F.scaled_dot_product_attention(grouped_query, context[0], context[1], attn_mask=chunk.mask,
                                             scale=scale)
    return out.reshape(batch, num_heads, head_dim)


class TorchPagedAttentionBackend(AttentionBackend):
    """Paged attention in plain PyTorch: batched decodes, one SDPA call per prefill chunk."""

    name = "torch_paged"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        validate_inputs(query, key, kv_cache, metadata, sliding_window)
        num_tokens = metadata.num_actual_tokens
        # Only the step's real tokens are written: padding rows (graph padding) never touch the cache.
        self._write_kv(key[:num_tokens], value[:num_tokens], kv_cache, metadata.slot_mapping[:num_tokens])
        output = torch.empty_like(query)
        if num_tokens < query.shape[0]:
            output[num_tokens:].zero_()  # padding rows (e.g. graph padding) carry no attention
        num_decodes = metadata.num_decodes
        if num_decodes > 0:
            self._forward_decodes(query, kv_cache, metadata, scale, sliding_window, output)
        if num_decodes < metadata.num_seqs:
            self._forward_prefills(query, key, value, kv_cache, metadata, scale, sliding_window, output)
        return output

    def _write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
        """Writes this step's K/V rows [num_tokens, num_kv_heads, head_dim] into `kv_cache` at the flat slots
        `slot_mapping` [num_tokens] (int64), converting to the cache's dtype. Subclasses may replace it
        (cpu_native: one native call); write_to_kv_cache stays the reference."""
        write_to_kv_cache(key, value, kv_cache, slot_mapping)

    def _forward_prefills(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        output: torch.Tensor,
    ) -> None:
        """Attends the requests after the first `num_decodes` (prefill chunks, multi-token steps) into their rows
        of `output`, one `_forward_request` each; their K/V are already in the cache."""
        starts = metadata.query_start_loc_cpu
        for index in range(metadata.num_decodes, metadata.num_seqs):
            start, end = starts[index], starts[index + 1]
            if end > start:
                output[start:end] = self._forward_request(index, query, key, value, kv_cache, metadata, scale,
                                                          sliding_window)

    def _forward_request(
        self,
        index: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Attends request `index` (not a batched decode: a prefill chunk or a multi-token step); returns
        its rows of the output, [q_len, num_heads, head_dim]."""
        start, end = metadata.query_start_loc_cpu[index], metadata.query_start_loc_cpu[index + 1]
        seq_len = metadata.seq_lens_cpu[index]
        q_len = end - start
        if q_len == seq_len and not is_int8_kv_cache(kv_cache):
            # No cached prefix: the context is exactly this step's K/V, no need to read it back.
            first_key_position = 0
            context_key = key[start:end].transpose(0, 1)
            context_value = value[start:end].transpose(0, 1)
        else:
            block_size = metadata.block_size
            first_block = first_visible_block(seq_len - q_len, sliding_window, block_size)
            first_key_position = first_block * block_size
            context_key, context_value = gather_context(
                kv_cache, metadata.block_table[index], seq_len, first_block
            )
        return _attend_request(
            query[start:end], context_key, context_value, seq_len, first_key_position, scale, sliding_window
        )

    def _forward_decodes(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        output: torch.Tensor,
    ) -> None:
        """Attends the first `num_decodes` requests (one new token each; decode i's query is row i)."""
        num_decodes = metadata.num_decodes
        _, _, _, num_kv_heads, head_dim = kv_cache.shape
        # An int8 cache's gathered blocks are float32 (dequantized).
        cache_element_size = 4 if is_int8_kv_cache(kv_cache) else kv_cache.element_size()
        bytes_per_token = 2 * num_kv_heads * head_dim * max(query.element_size(), cache_element_size)
        key = ("torch_paged_decode_plan", sliding_window, query.dtype, bytes_per_token, query.device,
               DECODE_CHUNK_BYTES)
        plan = metadata.backend_cache.get(key)
        if plan is None:
            plan = _plan_decodes(metadata, sliding_window, bytes_per_token, query.dtype, query.device)
            metadata.backend_cache[key] = plan
        # Permute once into chunk order so that every chunk is a contiguous slice.
        sorted_query = query[:num_decodes].index_select(0, plan.order)
        sorted_output = torch.empty_like(sorted_query)
        for chunk in plan.chunks:
            sorted_output[chunk.start:chunk.end] = _attend_decode_chunk(
                sorted_query[chunk.start:chunk.end], kv_cache, chunk, scale)
        output[:num_decodes].index_copy_(0, plan.order, sorted_output)
