"""C8, the int8 cache of DeepSeek sparse attention (attention/sparse_int8_cache.py): quantize / dequantize error
bounds, the Hadamard rotation, the page's sizes (656 latent bytes a token at DeepSeek-V3.2's dimensions), the
indexer scoring int8 keys in place against the same scores over the dequantized keys and queries, and sparse MLA
over a C8 page against sparse MLA over a float cache holding the dequantized latents. (Page layout invariants:
tests/attention/test_kv_page_layout.py; the models' agreement with float and the capacity: tests/models/
test_deepseek_sparse_attention.py.)"""
from __future__ import annotations

import random

import pytest
import torch

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.hadamard_rotation import hadamard_matrix, rotate
from pagedserve.attention.kv_cache_spec import ExtraKVComponent
from pagedserve.attention.kv_page_layout import kv_cache_component
from pagedserve.attention.kv_quantization import dequantize
from pagedserve.attention.lightning_indexer import INDEX_KEY_COMPONENT, index_scores, select_tokens
from pagedserve.attention.lightning_indexer import write_index_keys as write_float_index_keys
from pagedserve.attention.sparse_int8_cache import (
    LATENT_ROPE_COMPONENT,
    LATENT_SCALES_COMPONENT,
    SparseInt8PageLayout,
    SparseMLAKVCacheSpec,
    dequantize_latent_cache,
    dequantize_latent_tiles,
    index_key_caches,
    is_sparse_int8_cache,
    quantize_index_keys,
    quantize_index_query,
    quantize_latent_tiles,
    write_index_keys,
    write_latent,
)
from pagedserve.attention.sparse_mla import sparse_mla_attention

HEADS, NOPE, ROPE, V, RANK = 4, 16, 8, 12, 32
INDEX_HEADS, INDEX_DIM = 4, 16
BLOCK_SIZE, NUM_BLOCKS = 4, 48
SCALE, INDEX_SCALE = 0.3, 0.25
# (cached, new) per request: two decodes first, then a chunk over a cached prefix and a fresh prefill.
SCHEDULE = [(9, 1), (2, 1), (11, 6), (0, 13)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def _spec(rank: int = RANK, rope: int = ROPE, index_dim: int | None = INDEX_DIM) -> SparseMLAKVCacheSpec:
    extra = (ExtraKVComponent(INDEX_KEY_COMPONENT, (index_dim,)),) if index_dim else ()
    return SparseMLAKVCacheSpec(per_token_shape=(rank + rope,), supports_int8=True, latent_rank=rank,
                                extra_components=extra, index_head_dim=index_dim)


@pytest.mark.parametrize("rank,num_tiles", [(16, 1), (128, 1), (512, 4)])
def test_latent_tiles_err_by_at_most_half_a_scale(rank: int, num_tiles: int) -> None:
    generator = torch.Generator().manual_seed(rank)
    # Tiles of very different magnitudes: each gets its own scale.
    latent = torch.randn(6, rank, generator=generator) * torch.logspace(-2, 2, rank // min(rank, 128)).repeat_interleave(
        min(rank, 128))
    latent[0] = 0  # an all-zero row reads back as zeros
    quantized, scales = quantize_latent_tiles(latent)
    assert quantized.dtype == torch.int8 and quantized.shape == latent.shape and scales.shape == (6, num_tiles)
    tiles = latent.view(6, num_tiles, -1)
    torch.testing.assert_close(scales, tiles.abs().amax(-1) / 127, rtol=0, atol=0)
    error = (dequantize_latent_tiles(quantized, scales) - latent).view(6, num_tiles, -1).abs()
    assert (error <= scales[..., None] / 2 * (1 + 1e-5)).all()
    assert error.max() > 0 and (dequantize_latent_tiles(quantized, scales)[0] == 0).all()
    with pytest.raises(ValueError, match="kv_lora_rank=192 must be a multiple of 128"):
        quantize_latent_tiles(torch.zeros(2, 192))


def test_index_keys_and_queries_err_by_at_most_half_a_scale_after_rotation() -> None:
    generator = torch.Generator().manual_seed(2)
    keys = torch.randn(9, INDEX_DIM, generator=generator)
    keys[:, :4] *= 30  # a few large channels: the rotation spreads them
    quantized, scales = quantize_index_keys(keys)
    rotated = rotate(keys)
    assert quantized.dtype == torch.int8 and scales.shape == (9,)
    assert ((dequantize(quantized, scales) - rotated).abs() <= scales[:, None] / 2 * (1 + 1e-5)).all()
    # The rotation lowers the worst row's scale relative to its norm (spread) and keeps norms.
    torch.testing.assert_close(rotated.norm(dim=-1), keys.norm(dim=-1))
    assert (scales * 127 < keys.abs().amax(-1)).all()
    query = torch.randn(9, INDEX_HEADS, INDEX_DIM, generator=generator)
    weights = torch.randn(9, INDEX_HEADS, generator=generator)
    query_int8, folded = quantize_index_query(query, weights)
    query_scales = rotate(query).abs().amax(-1) / 127
    torch.testing.assert_close(folded, weights * query_scales)
    error = (dequantize(query_int8, query_scales) - rotate(query)).abs()
    assert (error <= query_scales[..., None] / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("dim", [1, 2, 16, 128])
def test_hadamard_rotation_is_orthogonal_and_keeps_dot_products(dim: int) -> None:
    matrix = hadamard_matrix(dim)
    torch.testing.assert_close(matrix @ matrix.T, torch.eye(dim), rtol=0, atol=1e-6)
    assert torch.equal(matrix, matrix.T)
    assert torch.equal(matrix.abs(), torch.full((dim, dim), dim ** -0.5))
    generator = torch.Generator().manual_seed(dim)
    query, key = torch.randn(5, dim, generator=generator), torch.randn(7, dim, generator=generator)
    torch.testing.assert_close(rotate(query) @ rotate(key).T, query @ key.T, rtol=1e-5, atol=1e-5)


def test_non_power_of_two_index_head_dim_is_refused() -> None:
    with pytest.raises(ValueError, match="index_head_dim=48 must be a power of two"):
        hadamard_matrix(48)
    with pytest.raises(ValueError, match="index_head_dim=24 must be a power of two.*kv_cache_dtype='int8'"):
        _spec(index_dim=24).page_layout(16, torch.bfloat16, "int8")
    _spec(index_dim=24).page_layout(16, torch.bfloat16)  # the float page has no rotation


def test_sizes_at_deepseek_v32_dimensions() -> None:
    """kv_lora_rank 512, rope 64, index_head_dim 128: 656 bytes of latent a token (512 int8 + 64 bf16 + 4 float32
    tile scales) + 132 of index key, against 1408 in bfloat16."""
    layout = SparseInt8PageLayout(64, 512, 64, 128)
    assert layout.num_latent_tiles == 4
    sizes = {c.name: c.page_bytes(1) for c in layout.page_layout.components}
    assert sizes["latent_nope"] + sizes[LATENT_ROPE_COMPONENT] + sizes[LATENT_SCALES_COMPONENT] == 656
    assert sizes[INDEX_KEY_COMPONENT] + sizes["index_key_scale"] == 132
    assert layout.bytes_per_token() == 788 and layout.page_layout.page_bytes == 64 * 788
    spec = _spec(512, 64, 128)
    assert spec.bytes_per_block(64, torch.bfloat16) == 64 * 1408
    assert spec.bytes_per_block(64, torch.bfloat16, "int8") == 64 * 788
    # A layer without an indexer (GLM-5 "shared"): the latent only.
    assert _spec(512, 64, None).bytes_per_block(64, torch.bfloat16, "int8") == 64 * 656
    # The tiny test models: rank 16 is one tile.
    assert SparseInt8PageLayout(16, 16, 8, 16).bytes_per_token() == 16 + 16 + 4 + 16 + 4


class _Step:
    """A C8 page cache holding each request's history, a float32 cache holding the same values dequantized, and
    the metadata and inputs of one step."""

    def __init__(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.cache = _spec().page_layout(BLOCK_SIZE, torch.float32, "int8").allocate(NUM_BLOCKS, _zeros)
        assert is_sparse_int8_cache(self.cache)
        ids = list(range(1, NUM_BLOCKS))
        random.Random(seed).shuffle(ids)
        self.tables, self.slots = [], []
        for cached, new in SCHEDULE:
            count = -(-(cached + new) // BLOCK_SIZE)
            self.tables.append(ids[:count])
            ids = ids[count:]
            self.slots.append([self.tables[-1][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                               for p in range(cached + new)])
        self.latents = [torch.randn(c + n, RANK + ROPE, generator=generator) * 2 for c, n in SCHEDULE]
        self.keys = [torch.randn(c + n, INDEX_DIM, generator=generator) for c, n in SCHEDULE]
        for (cached, _), slots, latent, keys in zip(SCHEDULE, self.slots, self.latents, self.keys):
            if cached:
                write_latent(latent[:cached], self.cache, torch.tensor(slots[:cached]), RANK)
                write_index_keys(keys[:cached], self.cache, torch.tensor(slots[:cached]))
        starts, step_slots = [0], []
        for (cached, new), slots in zip(SCHEDULE, self.slots):
            starts.append(starts[-1] + new)
            step_slots += slots[cached:]
        seq_lens = [cached + new for cached, new in SCHEDULE]
        width = max(len(t) for t in self.tables)
        self.metadata = AttentionMetadata(
            num_actual_tokens=starts[-1], slot_mapping=torch.tensor(step_slots), query_start_loc=torch.tensor(starts),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32),
            max_query_len=max(n for _, n in SCHEDULE), max_seq_len=max(seq_lens), num_decodes=2, num_decode_tokens=2,
            query_start_loc_cpu=starts, seq_lens_cpu=seq_lens, block_size=BLOCK_SIZE)
        num_tokens = starts[-1]
        self.new_latent = torch.cat([latent[c:] for (c, _), latent in zip(SCHEDULE, self.latents)])
        self.new_keys = torch.cat([keys[c:] for (c, _), keys in zip(SCHEDULE, self.keys)])
        self.index_query = torch.randn(num_tokens, INDEX_HEADS, INDEX_DIM, generator=generator)
        self.index_weights = torch.randn(num_tokens, INDEX_HEADS, generator=generator)
        self.q_nope = torch.randn(num_tokens, HEADS, NOPE, generator=generator)
        self.q_pe = torch.randn(num_tokens, HEADS, ROPE, generator=generator)
        self.kv_b = torch.randn(HEADS * (NOPE + V), RANK, generator=generator) * 0.3

    def float_key_cache(self, keys: list[torch.Tensor]) -> torch.Tensor:
        """A float32 index key cache holding `keys` (every token's, per request) at the step's slots."""
        cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, INDEX_DIM)
        for slots, request_keys in zip(self.slots, keys):
            write_float_index_keys(request_keys, cache, torch.tensor(slots))
        return cache


def test_int8_index_scores_in_place_equal_scores_over_dequantized_rows() -> None:
    step = _Step(seed=1)
    write_index_keys(step.new_keys, step.cache, step.metadata.slot_mapping)
    key_cache, scale_cache = index_key_caches(step.cache)
    query, weights = quantize_index_query(step.index_query, step.index_weights)
    # The oracle: float keys and queries holding the dequantized rotated values, scored as float.
    request, block_ids = 3, torch.tensor(step.tables[3])
    seq_len = SCHEDULE[request][1]
    keys_int8 = key_cache[block_ids].reshape(-1, INDEX_DIM)[:seq_len]
    key_scales = scale_cache[block_ids].reshape(-1)[:seq_len]
    rows = slice(step.metadata.query_start_loc_cpu[request], step.metadata.query_start_loc_cpu[request + 1])
    query_scales = rotate(step.index_query[rows]).abs().amax(-1) / 127
    in_place = index_scores(query[rows], weights[rows], keys_int8, INDEX_SCALE, key_scales)
    dequantized = index_scores(dequantize(query[rows], query_scales), step.index_weights[rows],
                               dequantize(keys_int8, key_scales), INDEX_SCALE)
    torch.testing.assert_close(in_place, dequantized, rtol=1e-5, atol=1e-5)
    # And the paged selection over int8 keys equals the float selection over the dequantized keys and queries.
    rotated_dequantized = [dequantize(*quantize_index_keys(keys)) for keys in step.keys]
    float_cache = step.float_key_cache(rotated_dequantized)
    all_query_scales = rotate(step.index_query).abs().amax(-1) / 127
    for top_k in (3, 7):
        int8_selection = select_tokens(query, weights, key_cache, step.metadata, top_k, INDEX_SCALE,
                                       key_scale_cache=scale_cache)
        float_selection = select_tokens(dequantize(query, all_query_scales), step.index_weights, float_cache,
                                        step.metadata, top_k, INDEX_SCALE)
        assert torch.equal(int8_selection.sort(-1).values, float_selection.sort(-1).values)


def test_int8_selection_overlaps_the_float_one() -> None:
    """On random data at least 95% of the int8 indexer's choices are the float indexer's."""
    overlaps, total = 0, 0
    for seed in range(4):
        step = _Step(seed=20 + seed)
        write_index_keys(step.new_keys, step.cache, step.metadata.slot_mapping)
        key_cache, scale_cache = index_key_caches(step.cache)
        query, weights = quantize_index_query(step.index_query, step.index_weights)
        int8_selection = select_tokens(query, weights, key_cache, step.metadata, 5, INDEX_SCALE,
                                       key_scale_cache=scale_cache)
        float_selection = select_tokens(step.index_query, step.index_weights, step.float_key_cache(step.keys),
                                        step.metadata, 5, INDEX_SCALE)
        for int8_row, float_row in zip(int8_selection.tolist(), float_selection.tolist()):
            chosen = {p for p in float_row if p >= 0}
            overlaps += len(chosen & {p for p in int8_row if p >= 0})
            total += len(chosen)
    print(f"int8 vs float indexer top-k overlap: {overlaps / total:.3f}")
    assert overlaps / total >= 0.95, overlaps / total


@pytest.mark.parametrize("top_k", [3, 7])
def test_sparse_mla_over_c8_equals_sparse_mla_over_the_dequantized_latents(top_k: int) -> None:
    """Decodes (absorbed over the gathered rows), a chunk over a cached prefix and a fresh prefill (expanded over
    the context) on the C8 page, against a float32 cache holding the dequantized latents."""
    step = _Step(seed=10 + top_k)
    selection = select_tokens(step.index_query, step.index_weights, step.float_key_cache(step.keys), step.metadata,
                              top_k, INDEX_SCALE)
    output = sparse_mla_attention(step.q_nope, step.q_pe, step.new_latent, step.cache, step.metadata, selection,
                                  step.kv_b, RANK, V, SCALE)
    # The step's latents were written: c int8 per tile, k_pe in bfloat16.
    block_ids, offsets = step.metadata.slot_mapping // BLOCK_SIZE, step.metadata.slot_mapping % BLOCK_SIZE
    rope = kv_cache_component(step.cache, LATENT_ROPE_COMPONENT)[block_ids, offsets]
    assert torch.equal(rope, step.new_latent[:, RANK:].to(torch.bfloat16))
    dense = dequantize_latent_cache(step.cache)
    new_latent = dense[block_ids, offsets]
    reference = sparse_mla_attention(step.q_nope, step.q_pe, new_latent, dense.clone(), step.metadata, selection,
                                     step.kv_b, RANK, V, SCALE)
    torch.testing.assert_close(output, reference, rtol=1e-5, atol=1e-5)
    unquantized = sparse_mla_attention(step.q_nope, step.q_pe, step.new_latent, dense.clone(), step.metadata,
                                       selection, step.kv_b, RANK, V, SCALE)
    relative = ((output - unquantized).abs().max() / unquantized.abs().max()).item()
    assert 1e-5 < relative < 0.05  # the new tokens' own latents are quantized too


def test_reads_dequantize_only_the_rows_they_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every token, decode or prefill, dequantizes only its selected rows (width per token), never a request's
    whole context."""
    from pagedserve.attention import sparse_int8_cache

    step = _Step(seed=4)
    selection = select_tokens(step.index_query, step.index_weights, step.float_key_cache(step.keys), step.metadata,
                              3, INDEX_SCALE)
    num_rows = []
    original = sparse_int8_cache.dequantize_latent_tiles

    def counting(quantized: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        num_rows.append(quantized.numel() // RANK)
        return original(quantized, scales)

    monkeypatch.setattr(sparse_int8_cache, "dequantize_latent_tiles", counting)
    sparse_mla_attention(step.q_nope, step.q_pe, step.new_latent, step.cache, step.metadata, selection, step.kv_b,
                         RANK, V, SCALE)
    assert num_rows == [2 * selection.shape[1]] + [new * selection.shape[1] for _, new in SCHEDULE[2:]]
    assert max(num_rows) < NUM_BLOCKS * BLOCK_SIZE // 4  # never the whole cache


def test_decodes_never_read_unselected_rows() -> None:
    """Scales of every row a decode did not select are NaN: its output stays finite and unchanged."""
    step = _Step(seed=5)
    selection = select_tokens(step.index_query, step.index_weights, step.float_key_cache(step.keys), step.metadata,
                              3, INDEX_SCALE)
    clean = sparse_mla_attention(step.q_nope, step.q_pe, step.new_latent, step.cache, step.metadata, selection,
                                 step.kv_b, RANK, V, SCALE)
    scales = kv_cache_component(step.cache, LATENT_SCALES_COMPONENT)
    keep = torch.zeros(scales.shape[:2], dtype=torch.bool)
    for request in range(2):  # the two decodes
        for position in selection[request].tolist():
            if position >= 0:
                keep[step.tables[request][position // BLOCK_SIZE], position % BLOCK_SIZE] = True
    scales[~keep] = float("nan")
    poisoned = sparse_mla_attention(step.q_nope[:2], step.q_pe[:2], step.new_latent[:2], step.cache,
                                    _decodes_only(step.metadata), selection[:2], step.kv_b, RANK, V, SCALE)
    assert torch.isfinite(poisoned).all()
    torch.testing.assert_close(poisoned, clean[:2], rtol=0, atol=0)


def _decodes_only(metadata: AttentionMetadata) -> AttentionMetadata:
    starts = metadata.query_start_loc_cpu[:3]
    return AttentionMetadata(
        num_actual_tokens=2, slot_mapping=metadata.slot_mapping[:2], query_start_loc=torch.tensor(starts),
        seq_lens=metadata.seq_lens[:2], block_table=metadata.block_table[:2], max_query_len=1,
        max_seq_len=max(metadata.seq_lens_cpu[:2]), num_decodes=2, num_decode_tokens=2, query_start_loc_cpu=starts,
        seq_lens_cpu=metadata.seq_lens_cpu[:2], block_size=BLOCK_SIZE)
