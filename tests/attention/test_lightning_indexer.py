"""The lightning indexer and sparse MLA (attention/lightning_indexer.py, attention/sparse_mla.py) against plain
references written per token: the selected positions equal a brute-force scoring loop (causal, top-k), sparse MLA
equals softmax attention over exactly the selected tokens' expanded K/V, and with top_k >= the context it equals
dense MLA (mla_paged_attention). The caches are DSA pages: the latent and the index keys share each page."""
from __future__ import annotations

import random

import pytest
import torch

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.kv_cache_spec import ExtraKVComponent, KVCacheSpec
from pagedserve.attention.kv_page_layout import kv_cache_component
from pagedserve.attention.lightning_indexer import (
    INDEX_KEY_COMPONENT,
    select_tokens,
    select_tokens_in_sequence,
    write_index_keys,
)
from pagedserve.attention.mla_paged import mla_paged_attention, write_latent_to_cache
from pagedserve.attention.sparse_mla import sparse_mla_attention

HEADS, NOPE, ROPE, V, RANK = 4, 16, 8, 12, 20
INDEX_HEADS, INDEX_DIM = 4, 16
BLOCK_SIZE, NUM_BLOCKS = 4, 48
SCALE = 0.3
# (cached, new) per request: two decodes first, then a chunk over a cached prefix and a fresh prefill.
SCHEDULE = [(9, 1), (2, 1), (11, 6), (0, 13)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


class _Step:
    """A DSA page cache holding each request's history, and the metadata and inputs of one step."""

    def __init__(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        spec = KVCacheSpec(per_token_shape=(RANK + ROPE,), latent_rank=RANK,
                           extra_components=(ExtraKVComponent(INDEX_KEY_COMPONENT, (INDEX_DIM,)),))
        self.cache = spec.page_layout(BLOCK_SIZE, torch.float32).allocate(NUM_BLOCKS, _zeros)
        self.key_cache = kv_cache_component(self.cache, INDEX_KEY_COMPONENT)
        ids = list(range(1, NUM_BLOCKS))
        random.Random(seed).shuffle(ids)
        tables, self.slots = [], []
        for cached, new in SCHEDULE:
            count = -(-(cached + new) // BLOCK_SIZE)
            tables.append(ids[:count])
            ids = ids[count:]
            self.slots.append([tables[-1][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached + new)])
        # Every token's latent and index key, history and new alike (the history is written now).
        self.latents = [torch.randn(c + n, RANK + ROPE, generator=generator) for c, n in SCHEDULE]
        self.keys = [torch.randn(c + n, INDEX_DIM, generator=generator) for c, n in SCHEDULE]
        for (cached, _), slots, latent, keys in zip(SCHEDULE, self.slots, self.latents, self.keys):
            if cached:
                write_latent_to_cache(latent[:cached], self.cache, torch.tensor(slots[:cached]))
                write_index_keys(keys[:cached], self.key_cache, torch.tensor(slots[:cached]))
        starts, step_slots = [0], []
        for (cached, new), slots in zip(SCHEDULE, self.slots):
            starts.append(starts[-1] + new)
            step_slots += slots[cached:]
        seq_lens = [cached + new for cached, new in SCHEDULE]
        width = max(len(t) for t in tables)
        self.metadata = AttentionMetadata(
            num_actual_tokens=starts[-1], slot_mapping=torch.tensor(step_slots), query_start_loc=torch.tensor(starts),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
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

    def token_requests(self) -> list[tuple[int, int]]:
        """(request, position) of every token of the step, in step order."""
        return [(request, position) for request, (cached, new) in enumerate(SCHEDULE)
                for position in range(cached, cached + new)]


def _brute_force_selection(step: _Step, top_k: int, softmax_scale: float) -> list[set[int]]:
    selected = []
    for row, (request, position) in enumerate(step.token_requests()):
        scores = []
        for source in range(position + 1):
            score = 0.0
            for head in range(INDEX_HEADS):
                dot = float(step.index_query[row, head] @ step.keys[request][source]) * softmax_scale
                score += float(step.index_weights[row, head]) * max(dot, 0.0)
            scores.append((score, source))
        scores.sort(reverse=True)
        selected.append({source for _, source in scores[:top_k]})
    return selected


@pytest.mark.parametrize("top_k", [1, 5, 12])
def test_selection_equals_brute_force_top_k(top_k: int) -> None:
    step = _Step(seed=top_k)
    write_index_keys(step.new_keys, step.key_cache, step.metadata.slot_mapping)
    selection = select_tokens(step.index_query, step.index_weights, step.key_cache, step.metadata, top_k, 0.25)
    assert selection.shape == (step.metadata.num_actual_tokens, min(top_k, max(step.metadata.seq_lens_cpu)))
    expected = _brute_force_selection(step, top_k, 0.25)
    for row, (_, position) in enumerate(step.token_requests()):
        chosen = [int(p) for p in selection[row] if p >= 0]
        assert len(chosen) == len(set(chosen)) == min(top_k, position + 1)
        assert max(chosen) <= position  # causal: never a later token
        assert set(chosen) == expected[row], row


def _reference_sparse_attention(step: _Step, selected: list[set[int]]) -> torch.Tensor:
    """Softmax attention of each token over exactly its selected tokens' expanded K/V (no cache, no absorption)."""
    outputs = []
    weight = step.kv_b.view(HEADS, NOPE + V, RANK)
    for row, (request, _) in enumerate(step.token_requests()):
        positions = sorted(selected[row])
        latent = step.latents[request][positions]  # [k, R + rope]
        k_nope = torch.einsum("hdr,kr->hkd", weight[:, :NOPE], latent[:, :RANK])
        values = torch.einsum("hvr,kr->hkv", weight[:, NOPE:], latent[:, :RANK])
        scores = (torch.einsum("hd,hkd->hk", step.q_nope[row], k_nope)
                  + step.q_pe[row] @ latent[:, RANK:].T) * SCALE
        outputs.append(torch.einsum("hk,hkv->hv", scores.softmax(-1), values))
    return torch.stack(outputs)


@pytest.mark.parametrize("top_k", [3, 7])
def test_sparse_mla_equals_attention_over_the_selected_tokens(top_k: int) -> None:
    step = _Step(seed=10 + top_k)
    write_index_keys(step.new_keys, step.key_cache, step.metadata.slot_mapping)
    selection = select_tokens(step.index_query, step.index_weights, step.key_cache, step.metadata, top_k, 0.25)
    output = sparse_mla_attention(step.q_nope, step.q_pe, step.new_latent, step.cache, step.metadata, selection,
                                  step.kv_b, RANK, V, SCALE)
    selected = [{int(p) for p in row if p >= 0} for row in selection]
    reference = _reference_sparse_attention(step, selected)
    torch.testing.assert_close(output, reference, rtol=1e-5, atol=1e-5)
    # The selection really drops tokens: dense attention differs.
    dense = _reference_sparse_attention(step, [set(range(p + 1)) for _, p in step.token_requests()])
    assert (output - dense).abs().max() > 1e-2
    # The step's latents landed in the page's latent component, the index keys beside them untouched by it.
    assert not step.cache.is_contiguous()  # the DSA page is interleaved: latent rows are page-strided
    block_ids, offsets = step.metadata.slot_mapping // BLOCK_SIZE, step.metadata.slot_mapping % BLOCK_SIZE
    assert torch.equal(step.cache[block_ids, offsets], step.new_latent)
    assert torch.equal(step.key_cache[block_ids, offsets], step.new_keys)



@pytest.mark.parametrize("rows_per_chunk", [1, 4, 64])
def test_gathered_prefill_equals_the_masked_reference(monkeypatch: pytest.MonkeyPatch, rows_per_chunk: int) -> None:
    """Prefill tokens gathering their selected rows in chunks of `rows_per_chunk` equal the dense-masked reference
    (the whole context expanded, unselected positions masked), the chunk over a cached prefix included."""
    from pagedserve.attention import sparse_mla

    step = _Step(seed=31)
    write_index_keys(step.new_keys, step.key_cache, step.metadata.slot_mapping)
    selection = select_tokens(step.index_query, step.index_weights, step.key_cache, step.metadata, 5, 0.25)
    width = selection.shape[1]
    monkeypatch.setattr(sparse_mla, "PREFILL_GATHER_BYTES", rows_per_chunk * width * (RANK + ROPE) * 4)
    assert sparse_mla.prefill_rows_per_chunk(width, RANK + ROPE) == rows_per_chunk
    gathered = sparse_mla_attention(step.q_nope, step.q_pe, step.new_latent, step.cache, step.metadata, selection,
                                    step.kv_b, RANK, V, SCALE)
    monkeypatch.setattr(sparse_mla, "attend_selected_prefills", sparse_mla.attend_masked_prefills)
    masked = sparse_mla_attention(step.q_nope, step.q_pe, step.new_latent, step.cache, step.metadata, selection,
                                  step.kv_b, RANK, V, SCALE)
    torch.testing.assert_close(gathered, masked, rtol=1e-5, atol=1e-5)
    # The prefill rows really are sparse: the two prefill requests see more than 5 tokens.
    assert (selection[2:] >= 0).sum(dim=1).max() == 5 < max(step.metadata.seq_lens_cpu)

def test_top_k_at_least_the_context_is_dense_mla() -> None:
    step = _Step(seed=3)
    write_index_keys(step.new_keys, step.key_cache, step.metadata.slot_mapping)
    top_k = max(step.metadata.seq_lens_cpu)
    selection = select_tokens(step.index_query, step.index_weights, step.key_cache, step.metadata, top_k, 0.25)
    sparse = sparse_mla_attention(step.q_nope, step.q_pe, step.new_latent, step.cache, step.metadata, selection,
                                  step.kv_b, RANK, V, SCALE)
    dense_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, RANK + ROPE)
    for (cached, _), slots, latent in zip(SCHEDULE, step.slots, step.latents):
        if cached:
            write_latent_to_cache(latent[:cached], dense_cache, torch.tensor(slots[:cached]))
    dense = mla_paged_attention(step.q_nope, step.q_pe, step.new_latent, dense_cache, step.metadata, step.kv_b, RANK,
                                V, SCALE)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)


def test_selection_in_one_sequence_equals_the_paged_one() -> None:
    """The cache-free path (profiling / dummy runs) selects as the paged path does for a lone prefill."""
    generator = torch.Generator().manual_seed(7)
    num_tokens = 11
    query = torch.randn(num_tokens, INDEX_HEADS, INDEX_DIM, generator=generator)
    weights = torch.randn(num_tokens, INDEX_HEADS, generator=generator)
    keys = torch.randn(num_tokens, INDEX_DIM, generator=generator)
    key_cache = torch.zeros(8, BLOCK_SIZE, INDEX_DIM)
    table = [5, 2, 7]
    slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(num_tokens)])
    write_index_keys(keys, key_cache, slots)
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens, slot_mapping=slots, query_start_loc=torch.tensor([0, num_tokens]),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32), block_table=torch.tensor([table], dtype=torch.int32),
        max_query_len=num_tokens, max_seq_len=num_tokens, num_decodes=0, num_decode_tokens=0,
        query_start_loc_cpu=[0, num_tokens], seq_lens_cpu=[num_tokens], block_size=BLOCK_SIZE)
    paged = select_tokens(query, weights, key_cache, metadata, 4, 0.5)
    assert torch.equal(select_tokens_in_sequence(query, weights, keys, 4, 0.5), paged)
    assert (paged[0, 1:] == -1).all() and paged[0, 0] == 0  # the first token sees only itself


def test_scoring_in_row_groups_selects_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """Long contexts score their query rows in groups and key tiles (bounded temporaries): the selection does not
    change."""
    from pagedserve.attention import lightning_indexer

    step = _Step(seed=21)
    write_index_keys(step.new_keys, step.key_cache, step.metadata.slot_mapping)
    whole = select_tokens(step.index_query, step.index_weights, step.key_cache, step.metadata, 5, 0.25)
    # Room for about one row's scores per group, and tiles of 4 keys.
    monkeypatch.setattr(lightning_indexer, "SCORE_CHUNK_BYTES", 4 * INDEX_HEADS * 20)
    monkeypatch.setattr(lightning_indexer, "KEY_TILE", 4)
    assert len(lightning_indexer._row_groups(13, INDEX_HEADS, 13)) > 1
    assert lightning_indexer.prefill_rows_per_group(INDEX_HEADS, 13) < 13
    grouped = select_tokens(step.index_query, step.index_weights, step.key_cache, step.metadata, 5, 0.25)
    assert torch.equal(grouped, whole)


def _same_top_k_sets(fast: tuple[torch.Tensor, torch.Tensor], reference: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Equal (value, position) sets row by row, whatever order each path gives them in."""
    fast_positions, order = fast[1].sort(dim=-1)
    reference_positions, reference_order = reference[1].sort(dim=-1)
    return (torch.equal(fast_positions, reference_positions)
            and torch.allclose(fast[0].gather(-1, order), reference[0].gather(-1, reference_order), rtol=0, atol=0,
                               equal_nan=True))


@pytest.mark.parametrize("num_keys", [100, 389, 1024])
def test_top_k_over_block_maxima_equals_the_whole_row_top_k(monkeypatch: pytest.MonkeyPatch, num_keys: int) -> None:
    """Long rows' top-k over the blocks of highest maximum equals torch.topk over the whole row, rows tied at the
    boundary (ReLU's zeros), holding a NaN, or with fewer visible keys than top_k included (100: fewer whole blocks than top_k + 1; 389: a partial tail)."""
    from pagedserve.attention import lightning_indexer

    monkeypatch.setattr(lightning_indexer, "SELECTION_BLOCK", 8)
    monkeypatch.setattr(lightning_indexer, "BLOCK_SELECTION_MIN_KEYS_PER_CHOICE", 4)
    generator = torch.Generator().manual_seed(num_keys)
    count = 16
    scores = torch.randn(12, num_keys, generator=generator)
    scores[:, -5:] = float("-inf")  # causal: hidden keys
    scores[1] = scores[1].clamp(min=0.0)  # half the row ties at zero, the boundary among them
    scores[2, : num_keys // 2] = 0.0
    scores[2, num_keys // 2:] = -scores[2, num_keys // 2:].abs()  # the zeros tie far past the boundary
    scores[3, 7] = float("nan")
    scores[4, count - 4:] = float("-inf")  # fewer visible keys than count
    scores[5] = scores[5].round()  # many equal integers: ties at the boundary within the kept blocks
    scores[6, ::37] = 50.0  # the top all equal, spread over blocks
    reference = lightning_indexer.top_k_by_full_sort(scores, count)
    fast = lightning_indexer.top_k_by_block_maxima(scores, count)
    assert _same_top_k_sets(fast, reference)
    # The fast path really took its own route on the plain rows: the kept blocks held their top-k.
    plain = scores[[0, 7, 8, 9, 10, 11]]
    assert _same_top_k_sets(lightning_indexer.top_k_by_block_maxima(plain, count),
                            lightning_indexer.top_k_by_full_sort(plain, count))


def test_prefill_selection_over_block_maxima_equals_the_whole_row_top_k(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prefill's selection (select_request_tokens, row groups and key tiles) is the same through the block
    maxima as through topk over each whole row."""
    from pagedserve.attention import lightning_indexer

    generator = torch.Generator().manual_seed(3)
    num_keys, num_rows, top_k = 600, 40, 8
    query = torch.randn(num_rows, INDEX_HEADS, INDEX_DIM, generator=generator)
    weights = torch.randn(num_rows, INDEX_HEADS, generator=generator)  # negative weights: zero and negative scores
    keys = torch.randn(num_keys, INDEX_DIM, generator=generator)
    args = (query, weights, keys, num_keys - num_rows, top_k, top_k, 0.25)
    monkeypatch.setattr(lightning_indexer, "top_k_by_block_maxima", lightning_indexer.top_k_by_full_sort)
    reference = lightning_indexer.select_request_tokens(*args)
    monkeypatch.undo()
    monkeypatch.setattr(lightning_indexer, "SELECTION_BLOCK", 8)
    monkeypatch.setattr(lightning_indexer, "BLOCK_SELECTION_MIN_KEYS_PER_CHOICE", 4)
    assert torch.equal(lightning_indexer.select_request_tokens(*args), reference)
