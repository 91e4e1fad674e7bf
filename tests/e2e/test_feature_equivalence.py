"""Every scheduling/caching feature on vs off gives identical greedy outputs (float32, tiny llama)."""
from __future__ import annotations

import random

import pytest

from pagedserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


def _random_prompts(num: int, low: int, high: int, seed: int, vocab: int = 400) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab) for _ in range(rng.randint(low, high))] for _ in range(num)]


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_prefix_caching_on_off_equal(folder: str) -> None:
    rng = random.Random(0)
    shared = [rng.randrange(8, 400) for _ in range(40)]
    prompts = [shared + [rng.randrange(8, 400) for _ in range(rng.randint(1, 20))] for _ in range(6)]
    without_cache = _generate(LLM(folder, enable_prefix_caching=False, max_model_len=256, num_kv_blocks=128), prompts)
    llm = LLM(folder, enable_prefix_caching=True, max_model_len=256, num_kv_blocks=128)
    first = _generate(llm, prompts)
    stats_after_first = llm.llm_engine.engine_core.make_stats()
    second = _generate(llm, prompts)
    stats_after_second = llm.llm_engine.engine_core.make_stats()
    assert first == without_cache
    assert second == without_cache
    # The second pass finds every prompt's full blocks (the shared 40-token prefix at least).
    assert stats_after_second.prefix_cache_hits - stats_after_first.prefix_cache_hits >= 6 * 32
    assert stats_after_second.prefix_cache_queries > stats_after_first.prefix_cache_queries
    # After reset_prefix_cache the same prompts find nothing cached and give the same tokens; the shared prefix
    # is cached again within the batch (the first prompt's blocks serve the others), so hits stay below 6 * 32.
    assert llm.reset_prefix_cache()
    third = _generate(llm, [prompts[0]])
    stats_after_third = llm.llm_engine.engine_core.make_stats()
    assert third == without_cache[:1]
    assert stats_after_third.prefix_cache_hits == stats_after_second.prefix_cache_hits


def test_reset_prefix_cache_refused_while_requests_run(folder: str) -> None:
    llm = LLM(folder, enable_prefix_caching=True, max_model_len=256, num_kv_blocks=128)
    llm.llm_engine.add_request("r0", {"prompt_token_ids": list(range(8, 48))}, GREEDY)
    llm.llm_engine.step()
    assert not llm.reset_prefix_cache()  # a running request holds blocks
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    assert llm.reset_prefix_cache()


def test_reset_prefix_cache_after_generate_with_async_scheduling(folder: str) -> None:
    """Async scheduling queues the next step before the last outputs arrive, so generate() can return with a
    step still in flight; reset_prefix_cache completes it and resets every time (a rerun then computes its
    prompts again: no prefix hits, the same tokens)."""
    llm = LLM(folder, enable_prefix_caching=True, max_model_len=256, num_kv_blocks=256, async_scheduling=True)
    core = llm.llm_engine.engine_core
    rng = random.Random(1)
    num_left_in_flight = 0
    for _ in range(3):
        prompts = [[rng.randrange(8, 400) for _ in range(rng.randint(5, 60))] for _ in range(8)]
        params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(3, 30), ignore_eos=True) for _ in prompts]
        first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        num_left_in_flight += len(core.batch_queue)
        assert llm.reset_prefix_cache()
        assert not core.batch_queue
        hits_before = core.make_stats().prefix_cache_hits
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
        assert core.make_stats().prefix_cache_hits == hits_before
        assert llm.reset_prefix_cache()
    assert num_left_in_flight > 0  # the case this test is about did occur


def test_chunked_prefill_tiny_budget_equal(folder: str) -> None:
    prompts = _random_prompts(6, 20, 90, seed=1)
    reference = _generate(LLM(folder, max_model_len=256, num_kv_blocks=128, enable_prefix_caching=False), prompts)
    chunked = _generate(LLM(folder, max_model_len=256, num_kv_blocks=128, enable_prefix_caching=False,
                            max_num_batched_tokens=16, enable_chunked_prefill=True), prompts)
    assert chunked == reference


def test_chunked_prefill_with_prefix_cache_equal(folder: str) -> None:
    rng = random.Random(5)
    shared = [rng.randrange(8, 400) for _ in range(35)]
    prompts = [shared + [rng.randrange(8, 400) for _ in range(rng.randint(3, 30))] for _ in range(5)]
    reference = _generate(LLM(folder, max_model_len=256, num_kv_blocks=128, enable_prefix_caching=False), prompts)
    llm = LLM(folder, max_model_len=256, num_kv_blocks=128, max_num_batched_tokens=16)
    assert _generate(llm, prompts) == reference
    assert _generate(llm, prompts) == reference


def test_preemption_equal(folder: str) -> None:
    prompts = _random_prompts(8, 30, 60, seed=2)
    reference = _generate(LLM(folder, max_model_len=256, num_kv_blocks=256, enable_prefix_caching=False), prompts)
    # 8 requests of up to 84 tokens need up to 48 blocks together; 14 blocks force preemption.
    llm = LLM(folder, num_kv_blocks=14, max_model_len=128, enable_prefix_caching=False)
    assert _generate(llm, prompts) == reference
    assert llm.llm_engine.engine_core.make_stats().num_preemptions > 0


def test_preemption_with_prefix_cache_equal(folder: str) -> None:
    prompts = _random_prompts(8, 30, 60, seed=3)
    reference = _generate(LLM(folder, max_model_len=256, num_kv_blocks=256, enable_prefix_caching=False), prompts)
    llm = LLM(folder, num_kv_blocks=14, max_model_len=128, max_num_batched_tokens=32)
    assert _generate(llm, prompts) == reference
    assert llm.llm_engine.engine_core.make_stats().num_preemptions > 0


def test_batch_of_32_equals_alone(folder: str) -> None:
    prompts = _random_prompts(32, 1, 70, seed=4)
    rng = random.Random(4)
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 40), ignore_eos=True) for _ in prompts]
    llm = LLM(folder, max_model_len=256, num_kv_blocks=512, max_num_batched_tokens=256)
    together = [o.outputs[0].token_ids for o in
                llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    alone_llm = LLM(folder, max_model_len=256, num_kv_blocks=512, enable_prefix_caching=False)
    alone = [alone_llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0].outputs[0].token_ids
             for p, sp in zip(prompts, params)]
    assert together == alone
    assert [len(t) for t in together] == [sp.max_tokens for sp in params]
    assert not llm.llm_engine.has_unfinished_requests()
