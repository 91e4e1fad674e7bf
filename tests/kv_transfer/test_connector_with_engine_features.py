"""KV connectors beside other engine features: async scheduling (PullConnector on P and D, PoolConnector) and
speculative decoding on D (ngram; a draft model, whose own KV D recomputes over the pulled prompt or the prefix the
pool gave; EAGLE, whose drafter pages travel beside the target's). Each gives the greedy tokens of one engine without
disaggregation, D computes only each prompt's last token, and every block ends free on both sides. Block drafters,
and hidden-state drafters with the pool, are refused.

P runs in the test's process (its block server is a thread): the test steps it for the done notices.
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from generation_helpers import random_prompts
from pagedserve import LLM, SamplingParams
from pagedserve.config.kv_transfer import KVTransferConfig
from test_pull_connector import (ENGINE_KWARGS, GREEDY, assert_all_blocks_free, consumer_config, producer_config,
                                 record_scheduled_tokens, remote_params, token_ids)

# One engine worker, no data or context parallelism (what check_engine reads of the parallel config).
PARALLEL_1 = SimpleNamespace(data_parallel_size=1, decode_context_parallel_size=1, prefill_context_parallel_size=1,
                             tensor_parallel_size=1, pipeline_parallel_size=1, world_size_per_engine=1,
                             executor_backend="uni", distributed_executor_backend=None)
PREFILL = SamplingParams(temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})


def one_engine_token_ids(model: str, prompts: list[list[int]]) -> list[list[int]]:
    """The greedy tokens of a plain engine without a connector: the reference of every test here."""
    engine = LLM(model, **ENGINE_KWARGS)
    try:
        return token_ids(engine, prompts, GREEDY)
    finally:
        engine.llm_engine.shutdown()


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
    expected = one_engine_token_ids(model, prompts)
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
    expected = one_engine_token_ids(model, [prefix + suffix_b])
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
    expected = one_engine_token_ids(model, prompts)
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
    expected = one_engine_token_ids(model, [prefix + suffix])
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


def recording_drafts(llm: LLM) -> list[tuple[tuple[int, ...], list[int]]]:
    """(the request's known tokens, its drafts) for every proposal the engine's hidden-state drafter makes."""
    proposer = llm.llm_engine.engine_core.executor.worker.model_runner.speculator.hidden_state_proposer
    recorded: list[tuple[tuple[int, ...], list[int]]] = []
    propose = proposer.propose

    def recording_propose(batch, target, *args, **kwargs):  # type: ignore[no-untyped-def]
        drafts = propose(batch, target, *args, **kwargs)
        for request_id, request_drafts in zip(target.step.request_ids, drafts):
            if request_drafts:
                row = batch.requests[request_id].row
                recorded.append((tuple(batch.token_ids[row, :int(batch.num_tokens[row])].tolist()), request_drafts))
        return drafts

    proposer.propose = recording_propose
    return recorded


def hidden_state_drafter(method: str, tiny_model_dir, folder: str) -> tuple[str, dict[str, Any]]:  # type: ignore[no-untyped-def]
    """(target model folder, speculative_config) for a random drafter of `method` (tests/spec_decode's writers)."""
    import shutil

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "spec_decode"))
    from drafter_checkpoints import add_mtp_layers, write_eagle3_checkpoint, write_eagle_checkpoint

    if method == "mtp":  # the target's own MTP layer (DeepSeek-V3: MLA pages)
        shutil.copytree(tiny_model_dir("deepseek-v3"), folder)
        return add_mtp_layers(folder, seed=3), {"method": "mtp", "num_speculative_tokens": 3}
    model = tiny_model_dir("llama")
    write = write_eagle_checkpoint if method == "eagle" else write_eagle3_checkpoint
    return model, {"method": method, "model": write(folder, model, seed=1), "num_speculative_tokens": 3}


@pytest.mark.parametrize("method", ["eagle", pytest.param("eagle3", marks=pytest.mark.slow),
                                    pytest.param("mtp", marks=pytest.mark.slow)])
def test_hidden_state_drafter_kv_travels_with_the_target_pages(tiny_model_dir, tmp_path, caplog,  # type: ignore[no-untyped-def]
                                                               method: str) -> None:
    """EAGLE (slow: EAGLE-3, DeepSeek MTP) on P and D: D pulls the drafter's pages beside the target's (they come
    from the target's hidden states over the prompt, which only P computed), so every draft D proposes equals the
    draft one engine with the same drafter proposes for the same tokens, and D's greedy tokens equal one engine's
    without speculation. A P without the drafter fails D's load, naming the drafter's layer and the rule."""
    import logging

    model, eagle = hidden_state_drafter(method, tiny_model_dir, str(tmp_path / "drafter"))
    prompts = random_prompts(2, 30, 50, seed=39)
    expected = one_engine_token_ids(model, prompts)
    eagle_engine = LLM(model, speculative_config=eagle, **ENGINE_KWARGS)
    reference_drafts = recording_drafts(eagle_engine)
    assert token_ids(eagle_engine, prompts, GREEDY) == expected
    eagle_engine.llm_engine.shutdown()
    reference_by_tokens = dict(reference_drafts)

    producer = LLM(model, kv_transfer_config=producer_config(), speculative_config=eagle, **ENGINE_KWARGS)
    plain_producer = LLM(model, kv_transfer_config=producer_config(), **ENGINE_KWARGS)
    consumer = LLM(model, kv_transfer_config=consumer_config(policy="fail"), speculative_config=eagle,
                   **ENGINE_KWARGS)
    try:
        params = prefill(producer, prompts)
        scheduled = record_scheduled_tokens(consumer)
        drafts = recording_drafts(consumer)
        assert token_ids(consumer, prompts, [remote_params(value) for value in params]) == expected
        assert sorted(steps[0] for steps in scheduled.values()) == [1, 1]
        assert len(drafts) >= 2 * 3  # drafted all along, from the first token on
        assert [reference_by_tokens.get(tokens) for tokens, _ in drafts] == [draft for _, draft in drafts]
        assert_all_blocks_free(consumer)
        assert_all_blocks_free(producer)

        (plain_params,) = prefill(plain_producer, prompts[:1])
        with caplog.at_level(logging.ERROR, logger="pagedserve.kv_transfer.pull_connector_worker"):
            (failed,) = consumer.generate([{"prompt_token_ids": prompts[0]}], [remote_params(plain_params)],
                                          use_tqdm=False)
        assert failed.outputs[0].finish_reason == "error"
        assert "layer 'drafter." in caplog.text and "must run the same speculative_config" in caplog.text
        assert_all_blocks_free(consumer)
        assert_all_blocks_free(plain_producer)
    finally:
        for llm in (producer, plain_producer, consumer):
            llm.llm_engine.shutdown()


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_block_drafters_refused(method: str) -> None:
    """Their drafter's context KV over the prompt comes from the target's layers and does not travel."""
    config = KVTransferConfig.parse({"kv_connector": "PullConnector", "kv_role": "kv_consumer"})
    assert config is not None
    with pytest.raises(ValueError, match=f"speculative_config.method='{method}'.*use method 'ngram', 'draft_model', "
                                         f"'eagle', 'eagle3' or 'mtp'"):
        config.check_engine(PARALLEL_1, method)
    for allowed in ("ngram", "draft_model", "eagle", "eagle3", "mtp"):
        config.check_engine(PARALLEL_1, allowed)


def test_hidden_state_drafters_refused_with_the_pool() -> None:
    """A pool block is named by the target's tokens alone: a drafter's pages in it would be shared by engines whose
    drafters differ."""
    pool = {"kv_connector": "PoolConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"backend": "local"}}
    for value in (pool, {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                         "kv_connector_extra_config": {"connectors": [{"kv_connector": "PullConnector"}, pool]}}):
        config = KVTransferConfig.parse(value)
        assert config is not None
        with pytest.raises(ValueError, match="'PoolConnector' is not supported with speculative_config.method='eagle'"):
            config.check_engine(PARALLEL_1, "eagle")
        config.check_engine(PARALLEL_1, "draft_model")
