"""KV connectors beside other engine features: async scheduling (PullConnector on P and D, PoolConnector) and
speculative decoding on D (ngram; a draft model, whose own KV D recomputes over the pulled prompt or the prefix the
pool gave). Each gives the
greedy tokens of one engine without disaggregation, D computes only each prompt's last token, and every block ends
free on both sides. Drafters that read the target's hidden states are refused with a connector.

P runs in the test's process (its block server is a thread): the test steps it for the done notices.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from generation_helpers import random_prompts
from pagedserve import LLM, SamplingParams
from pagedserve.config.kv_transfer import KVTransferConfig
from test_pull_connector import (ENGINE_KWARGS, GREEDY, assert_all_blocks_free, consumer_config, producer_config,
                                 record_scheduled_tokens, remote_params, token_ids)

PREFILL = SamplingParams(temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})


def prefill(producer: LLM, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """P's kv_transfer_params for each prompt."""
    return [output.kv_transfer_params
            for output in producer.generate([{"prompt_token_ids": prompt} for prompt in prompts], PREFILL,
                                            use_tqdm=False)]


def test_pd_with_async_scheduling(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """P and D both schedule one step ahead. P prefills in 16-token chunks beside other requests' chunks, so a
    request finishes (and its blocks are held for D) while the next step is already queued; D's requests wait for
    their loads while other requests decode. D's greedy tokens equal one (synchronous) engine's, D computes one
    prompt token per request, and every block ends free on both sides."""
    model = tiny_model_dir("llama")
    prompts = random_prompts(4, 30, 60, seed=31)
    reference_engine = LLM(model, **ENGINE_KWARGS)
    expected = token_ids(reference_engine, prompts, GREEDY)
    reference_engine.llm_engine.shutdown()
    producer = LLM(model, kv_transfer_config=producer_config(), async_scheduling=True, max_num_batched_tokens=16,
                   **ENGINE_KWARGS)
    consumer = LLM(model, kv_transfer_config=consumer_config(policy="fail"), async_scheduling=True,
                   **ENGINE_KWARGS)
    try:
        assert producer.llm_engine.engine_core.batch_queue is not None  # the engines really run steps ahead
        assert consumer.llm_engine.engine_core.batch_queue is not None
        params = prefill(producer, prompts)
        scheduled = record_scheduled_tokens(consumer)
        # The first request alone, then the others while it decodes: loads end with a decode step in flight.
        engine = consumer.llm_engine
        engine.add_request("first", {"prompt_token_ids": prompts[0]}, remote_params(params[0]))
        outputs: dict[str, list[int]] = {}
        for _ in range(200):
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = output.outputs[0].token_ids
            if scheduled.get("first", [0])[-1] == 1 and len(scheduled["first"]) >= 3:
                break
        for index in range(1, len(prompts)):
            engine.add_request(f"r{index}", {"prompt_token_ids": prompts[index]}, remote_params(params[index]))
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    assert output.outputs[0].finish_reason == "length", output
                    outputs[output.request_id] = output.outputs[0].token_ids
        assert [outputs[request_id] for request_id in ["first", "r1", "r2", "r3"]] == expected
        assert sorted(steps[0] for steps in scheduled.values()) == [1, 1, 1, 1]
        assert_all_blocks_free(consumer)
        assert_all_blocks_free(producer)
    finally:
        producer.llm_engine.shutdown()
        consumer.llm_engine.shutdown()


def test_pool_with_async_scheduling(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """PoolConnector (the process's local tier) with async scheduling: engine B loads the prefix engine A stored and
    computes only its suffix, with the tokens of an engine without the pool."""
    model = tiny_model_dir("llama")
    prefix, suffix_a, suffix_b = random_prompts(3, 20, 30, seed=33)
    prefix = (prefix * 4)[:64]
    reference_engine = LLM(model, **ENGINE_KWARGS)
    expected = token_ids(reference_engine, [prefix + suffix_b], GREEDY)
    reference_engine.llm_engine.shutdown()
    pool = {"kv_connector": "PoolConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"backend": "local", "url": "local://async-scheduling-test"}}
    engine_a = LLM(model, kv_transfer_config=pool, async_scheduling=True, **ENGINE_KWARGS)
    engine_b = None
    try:
        token_ids(engine_a, [prefix + suffix_a], GREEDY)
        assert engine_a.llm_engine.engine_core.executor.worker.kv_connector.wait_for_stores(30.0)
        engine_b = LLM(model, kv_transfer_config=pool, async_scheduling=True, **ENGINE_KWARGS)
        scheduled = record_scheduled_tokens(engine_b)
        assert token_ids(engine_b, [prefix + suffix_b], GREEDY) == expected
        assert [steps[0] for steps in scheduled.values()] == [len(suffix_b)]  # the prefix came from the pool
        for engine in (engine_a, engine_b):
            assert_all_blocks_free(engine)
    finally:
        for engine in (engine_a, engine_b):
            if engine is not None:
                engine.llm_engine.shutdown()


def test_speculative_decoding_on_the_consumer(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """D speculates over KV pulled from a P without a drafter: with ngram, and with a draft model equal to the
    target, whose KV over the prompt D recomputes (the target's pages alone travel). Greedy tokens equal one engine
    without speculation; the target-as-drafter accepts every draft, which it would not over a drafter KV that
    missed the prompt."""
    model = tiny_model_dir("llama")
    # Repeated runs inside each prompt give ngram matches to draft from.
    prompts = [(prompt * 3)[:50] for prompt in random_prompts(2, 12, 18, seed=35)]
    reference_engine = LLM(model, **ENGINE_KWARGS)
    expected = token_ids(reference_engine, prompts, GREEDY)
    reference_engine.llm_engine.shutdown()
    producer = LLM(model, kv_transfer_config=producer_config(), **ENGINE_KWARGS)
    speculative_configs = [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        {"method": "draft_model", "model": model, "num_speculative_tokens": 3},
    ]
    try:
        for speculative_config in speculative_configs:
            params = prefill(producer, prompts)
            consumer = LLM(model, kv_transfer_config=consumer_config(policy="fail"),
                           speculative_config=speculative_config, **ENGINE_KWARGS)
            try:
                scheduled = record_scheduled_tokens(consumer)
                assert token_ids(consumer, prompts, [remote_params(value) for value in params]) == expected, \
                    speculative_config["method"]
                assert sorted(steps[0] for steps in scheduled.values()) == [1, 1]
                stats = consumer.llm_engine.engine_core.make_stats()
                assert stats.spec_decode_num_draft_tokens > 0
                if speculative_config["method"] == "draft_model":
                    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
                assert_all_blocks_free(consumer)
            finally:
                consumer.llm_engine.shutdown()
            assert_all_blocks_free(producer)
    finally:
        producer.llm_engine.shutdown()


def test_pool_with_a_draft_model(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """The pool holds the target's pages only: an engine with a draft model (the target itself) loads a prefix
    another engine without a drafter stored, recomputes its drafter's KV over it, and accepts every draft."""
    model = tiny_model_dir("llama")
    prefix, suffix = random_prompts(2, 20, 30, seed=37)
    prefix = (prefix * 4)[:64]
    reference_engine = LLM(model, **ENGINE_KWARGS)
    expected = token_ids(reference_engine, [prefix + suffix], GREEDY)
    reference_engine.llm_engine.shutdown()
    pool = {"kv_connector": "PoolConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"backend": "local", "url": "local://draft-model-test"}}
    engine_a = LLM(model, kv_transfer_config=pool, **ENGINE_KWARGS)
    engine_b = None
    try:
        token_ids(engine_a, [prefix + suffix[:3]], GREEDY)
        assert engine_a.llm_engine.engine_core.executor.worker.kv_connector.wait_for_stores(30.0)
        engine_b = LLM(model, kv_transfer_config=pool, speculative_config={
            "method": "draft_model", "model": model, "num_speculative_tokens": 3}, **ENGINE_KWARGS)
        scheduled = record_scheduled_tokens(engine_b)
        assert token_ids(engine_b, [prefix + suffix], GREEDY) == expected
        assert [steps[0] for steps in scheduled.values()] == [len(suffix)]  # the prefix came from the pool
        stats = engine_b.llm_engine.engine_core.make_stats()
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
        for engine in (engine_a, engine_b):
            assert_all_blocks_free(engine)
    finally:
        for engine in (engine_a, engine_b):
            if engine is not None:
                engine.llm_engine.shutdown()


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "dflash"])
def test_hidden_state_drafters_refused(method: str) -> None:
    """Their drafter's KV over the prompt comes from the target's hidden states, which only P computed."""
    config = KVTransferConfig.parse({"kv_connector": "PullConnector", "kv_role": "kv_consumer"})
    assert config is not None
    parallel = SimpleNamespace(data_parallel_size=1, decode_context_parallel_size=1, prefill_context_parallel_size=1,
                               tensor_parallel_size=1, pipeline_parallel_size=1, executor_backend="uni",
                               distributed_executor_backend=None)
    with pytest.raises(ValueError, match=f"speculative_config.method='{method}'.*use method 'ngram' or "
                                         f"'draft_model'"):
        config.check_engine(parallel, method)
    config.check_engine(parallel, "draft_model")
    config.check_engine(parallel, "ngram")
