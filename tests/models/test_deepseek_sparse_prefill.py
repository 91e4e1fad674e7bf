"""The gathered sparse prefill (attention/sparse_mla.attend_selected_prefills: each prompt token attends only its
selected latent rows, a bounded chunk of tokens at a time) against the plain dense-masked reference
(attend_masked_prefills: the whole context expanded, the selection a [q_len, context] mask) on the tiny DSA
checkpoints, float32: greedy tokens identical and their log-probabilities within 1e-4 over 16 steps (each a function
of every prompt token's attention output in the layers below). Prompts are longer than index_topk (8), so the
selection drops tokens (tests/attention/test_lightning_indexer.py shows the sparse output differs from dense);
prefill runs in 16-token chunks with prefix caching (the second pass reads cached latents and index keys back); the
prefill's query chunks are forced down to 3 tokens so a request's prefill takes several gathers. Also on C8 pages
(kv_cache_dtype="int8") and with sparse KV offload (the prefill reads its rows from the tier)."""
from __future__ import annotations

import random

import pytest
from tiny_models import DSA_KINDS

from pagedserve import LLM, SamplingParams
from pagedserve.attention import sparse_mla

NUM_NEW_TOKENS = 16
GREEDY_WITH_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=1)
LOGPROB_ATOL = 1e-4


def _prompts() -> list[list[int]]:
    """One 5-token prompt and three sharing a 35-token prefix (38, 46 and 55 tokens): all but the first exceed
    index_topk (8); the shared prefix is what prefix caching finds."""
    rng = random.Random(1)
    shared = [rng.randrange(8, 600) for _ in range(35)]
    return [[rng.randrange(8, 600) for _ in range(5)]] + [shared + [rng.randrange(8, 600) for _ in range(n)]
                                                          for n in (3, 11, 20)]


PROMPTS = _prompts()
TokensAndLogprobs = list[tuple[list[int], list[float]]]


def _run_twice(folder: str, **kwargs) -> list[TokensAndLogprobs]:
    """Greedy tokens and their log-probabilities, twice over the prompts in one engine (the second pass hits the
    prefix cache)."""
    llm = LLM(folder, dtype="float32", max_model_len=128, num_kv_blocks=128, enable_prefix_caching=True,
              enable_chunked_prefill=True, max_num_batched_tokens=16, **kwargs)
    passes = []
    for _ in range(2):
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY_WITH_LOGPROBS, use_tqdm=False)
        passes.append([(list(o.outputs[0].token_ids),
                        [step[token].logprob for step, token in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                       for o in outputs])
    assert llm.llm_engine.engine_core.make_stats().prefix_cache_hits >= 3 * 32
    return passes


def _gathered_and_masked(monkeypatch: pytest.MonkeyPatch, folder: str,
                         **kwargs) -> tuple[list[TokensAndLogprobs], list[TokensAndLogprobs]]:
    with monkeypatch.context() as patch:
        # Three query rows per gather (width 8, row width 24, float32): a prefill chunk takes several.
        patch.setattr(sparse_mla, "PREFILL_GATHER_BYTES", 3 * 8 * 24 * 4)
        assert sparse_mla.prefill_rows_per_chunk(8, 24) == 3
        gathered = _run_twice(folder, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(sparse_mla, "attend_selected_prefills", sparse_mla.attend_masked_prefills)
        masked = _run_twice(folder, **kwargs)
    return gathered, masked


def _assert_equal(gathered: list[TokensAndLogprobs], masked: list[TokensAndLogprobs]) -> None:
    for pass_index, (gathered_pass, masked_pass) in enumerate(zip(gathered, masked)):
        for prompt_index, ((tokens, logprobs), (reference_tokens, reference_logprobs)) in enumerate(
                zip(gathered_pass, masked_pass)):
            where = f"pass {pass_index} prompt {prompt_index}"
            assert tokens == reference_tokens, where
            assert logprobs == pytest.approx(reference_logprobs, abs=LOGPROB_ATOL), where


@pytest.mark.parametrize("kind", DSA_KINDS)
def test_gathered_prefill_equals_masked_reference(tiny_model_dir, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    _assert_equal(*_gathered_and_masked(monkeypatch, tiny_model_dir(kind)))


def test_gathered_prefill_equals_masked_reference_on_c8_pages(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    _assert_equal(*_gathered_and_masked(monkeypatch, tiny_model_dir("glm-moe-dsa"), kv_cache_dtype="int8"))


def test_gathered_prefill_equals_masked_reference_with_sparse_kv_offload(
        tiny_model_dir, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    offload = {"num_resident_blocks": 3, "tier_directory": str(tmp_path)}
    _assert_equal(*_gathered_and_masked(monkeypatch, tiny_model_dir("glm-moe-dsa"), block_size=4,
                                        sparse_kv_offload=offload))



@pytest.mark.slow  # ~20 CPU s; tests/attention/test_lightning_indexer.py's block-maxima tests cover the same code
@pytest.mark.parametrize("kind, kv_cache_dtype", [("deepseek-v32", "auto"), ("glm-moe-dsa", "int8")])
def test_top_k_over_block_maxima_equals_whole_row_top_k_end_to_end(
        tiny_model_dir, monkeypatch: pytest.MonkeyPatch, kind: str, kv_cache_dtype: str) -> None:
    """The indexer's top-k over block maxima (forced onto every row of 18+ keys: blocks of 2) against torch.topk over
    each whole row: the same selections, so the same greedy tokens and bit-equal log-probabilities; C8's int8 keys
    make tied scores common."""
    from pagedserve.attention import lightning_indexer

    folder = tiny_model_dir(kind)
    with monkeypatch.context() as patch:
        patch.setattr(lightning_indexer, "SELECTION_BLOCK", 2)
        patch.setattr(lightning_indexer, "BLOCK_SELECTION_MIN_KEYS_PER_CHOICE", 2)
        fast = _run_twice(folder, kv_cache_dtype=kv_cache_dtype)
    with monkeypatch.context() as patch:
        patch.setattr(lightning_indexer, "top_k_by_block_maxima", lightning_indexer.top_k_by_full_sort)
        reference = _run_twice(folder, kv_cache_dtype=kv_cache_dtype)
    assert fast == reference
