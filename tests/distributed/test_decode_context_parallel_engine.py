"""Decode context parallel over two gloo ranks (tensor_parallel_size=2, decode_context_parallel_size=2): float32
greedy tokens equal to one process for dense attention (GQA whose KV head both ranks hold, with and without a
sliding window), MLA and DeepSeek sparse attention (float and C8 pages), with chunked prefill and prefix-cache hits; the KV capacity doubles; bad combinations fail
at start naming the knobs."""
from __future__ import annotations

import random

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.config.engine import EngineConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def _prompts() -> list[list[int]]:
    """Two prompts sharing a 40-token prefix (more than one 32-position block of the DCP pair) and a short one."""
    rng = random.Random(3)
    shared = [rng.randrange(8, 600) for _ in range(40)]
    return [shared + [rng.randrange(8, 600) for _ in range(9)], [rng.randrange(8, 600) for _ in range(3)],
            shared + [rng.randrange(8, 600) for _ in range(17)]]


PROMPTS = _prompts()


def _generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


ENGINE = dict(dtype="float32", max_model_len=256, num_kv_blocks=40, max_num_batched_tokens=24, max_num_seqs=4)


# The sliding window's masks are covered by the one-process partial tests, GLM-5's shared layers (which reuse the
# global selection) by DeepSeek-V3.2's run: those two engine pairs run with `-m slow`.
@pytest.mark.parametrize("kind", ["llama", pytest.param("qwen2-sliding", marks=pytest.mark.slow), "deepseek-v3",
                                  "deepseek-v32", pytest.param("glm-moe-dsa", marks=pytest.mark.slow)])
def test_dcp_2_equals_one_process(tiny_model_dir, kind: str) -> None:
    """DeepSeek-V3.2 / GLM-5 (index_topk 8, below the prompts): the global top-k merges the ranks' candidates."""
    overrides = {"num_key_value_heads": 1} if kind in ("llama", "qwen2-sliding") else {}
    if kind == "qwen2-sliding":
        overrides["sliding_window"] = 20  # below the prompts' lengths: the window hides positions on both ranks
    folder = tiny_model_dir(kind, **overrides)
    single = _generate(LLM(folder, **ENGINE))
    llm = LLM(folder, tensor_parallel_size=2, decode_context_parallel_size=2, enable_prefix_caching=True,
              **ENGINE)
    core = llm.llm_engine.engine_core
    try:
        first = _generate(llm)
        hits_before = core.make_stats().prefix_cache_hits
        second = _generate(llm)  # the shared prefixes now come from the prefix cache
        # Every prompt's whole 32-position blocks: 32 + 0 + 32 (a hit leaves at least one token to compute).
        assert core.make_stats().prefix_cache_hits - hits_before >= 64
    finally:
        llm.llm_engine.shutdown()
    assert first == single
    assert second == single


def test_dcp_2_with_c8_pages_equals_one_process_with_c8(tiny_model_dir) -> None:
    """kv_cache_dtype='int8' on DeepSeek-V3.2: each rank quantizes its own positions exactly as one process does."""
    folder = tiny_model_dir("deepseek-v32")
    single = _generate(LLM(folder, kv_cache_dtype="int8", **ENGINE))
    llm = LLM(folder, tensor_parallel_size=2, decode_context_parallel_size=2, kv_cache_dtype="int8", **ENGINE)
    try:
        assert _generate(llm) == single
    finally:
        llm.llm_engine.shutdown()


def test_dcp_doubles_the_positions_a_block_budget_holds(tiny_model_dir) -> None:
    """9 blocks (one is the null block) hold 8 x 16 positions on one rank, 8 x 32 over a DCP pair."""
    folder = tiny_model_dir("deepseek-v3")
    with pytest.raises(ValueError, match="fewer than max_model_len=256"):
        LLM(folder, dtype="float32", max_model_len=256, num_kv_blocks=9)
    llm = LLM(folder, dtype="float32", max_model_len=256, num_kv_blocks=9, tensor_parallel_size=2,
              decode_context_parallel_size=2)
    try:
        long_prompt = [random.Random(5).randrange(8, 600) for _ in range(200)]
        output = llm.generate([{"prompt_token_ids": long_prompt}], SamplingParams(temperature=0.0, max_tokens=40,
                                                                                  ignore_eos=True), use_tqdm=False)
        assert len(output[0].outputs[0].token_ids) == 40
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=2, decode_context_parallel_size=4), "must divide tensor_parallel_size=2"),
    (dict(kind="llama", tensor_parallel_size=2, decode_context_parallel_size=2),
     "needs each KV head replicated on a multiple of 2"),
    (dict(tensor_parallel_size=2, decode_context_parallel_size=2, attention_backend="torch_paged"),
     "attention_backend='torch_paged' does not split KV positions"),
    (dict(tensor_parallel_size=2, decode_context_parallel_size=2, batch_invariant=True),
     "batch_invariant=True has no context-parallel form"),
    (dict(attention_backend="decode_context_parallel"), "is chosen by decode_context_parallel_size > 1"),
    (dict(tensor_parallel_size=2, decode_context_parallel_size=2, profiling_chunk_config={"enable": True}),
     "profiling_chunk_config.enable=True times forwards without the context-parallel split"),
])
def test_bad_combinations_fail_at_start(tiny_model_dir, kwargs: dict, message: str) -> None:
    kind = kwargs.pop("kind", "deepseek-v3")
    with pytest.raises(ValueError, match=message):
        EngineConfig.create(tiny_model_dir(kind), **kwargs)


def test_drafters_other_than_ngram_are_refused(tiny_model_dir) -> None:
    """A draft model's own attention layers would need their own position split: refused at start."""
    folder = tiny_model_dir("deepseek-v3")
    with pytest.raises(ValueError, match="supports speculative_config.method 'ngram' only, not 'draft_model'"):
        EngineConfig.create(folder, tensor_parallel_size=2, decode_context_parallel_size=2,
                            speculative_config={"method": "draft_model", "model": folder,
                                                "num_speculative_tokens": 2})
