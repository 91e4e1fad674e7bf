"""The pull connector over Mooncake's Transfer Engine (transport "mooncake"): D reads P's blocks cache to cache
and its greedy tokens equal one engine's (dense and MLA pages), the bytes really come from P's cache (zeroing it
changes D's tokens), a producer on the other transport is refused at handshake naming both, and every block ends
free. Skipped, naming why, where Mooncake cannot be imported (its wheel needs Debian's libibverbs1)."""
from __future__ import annotations

import logging

import pytest

from generation_helpers import random_prompts
from pagedserve import LLM, SamplingParams
from pagedserve.kv_transfer.mooncake_block_transport import _joint_runs

try:
    import mooncake.engine  # noqa: F401
    MOONCAKE_MISSING = ""
except ImportError as error:  # the wheel, or libibverbs.so.1 it links, is missing
    MOONCAKE_MISSING = f"Mooncake's Transfer Engine cannot be imported: {error}"

from test_pull_connector import (ENGINE_KWARGS, GREEDY, assert_all_blocks_free, consumer_config, producer_config,
                                 remote_params, token_ids)

needs_mooncake = pytest.mark.skipif(bool(MOONCAKE_MISSING), reason=MOONCAKE_MISSING)
PREFILL_ONLY = SamplingParams(temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})


def test_joint_runs_need_both_sides_consecutive() -> None:
    assert _joint_runs([3, 4, 5, 9], [7, 8, 9, 10]) == [(3, 7, 3), (9, 10, 1)]
    assert _joint_runs([3, 4, 5], [7, 9, 10]) == [(3, 7, 1), (4, 9, 2)]
    assert _joint_runs([], []) == []


def _prefill(producer: LLM, prompts: list[list[int]]) -> list[dict]:
    return [output.kv_transfer_params for output in producer.generate(
        [{"prompt_token_ids": prompt} for prompt in prompts], PREFILL_ONLY, use_tqdm=False)]


@needs_mooncake
@pytest.mark.parametrize("kind", ["llama", "deepseek-v3"])
def test_mooncake_pd_equals_one_engine_and_reads_the_producers_cache(tiny_model_dir, kind: str) -> None:
    model = tiny_model_dir(kind)
    prompts = random_prompts(3, 30, 60, seed=21)
    reference_engine = LLM(model, **ENGINE_KWARGS)
    expected = token_ids(reference_engine, prompts, GREEDY)
    reference_engine.llm_engine.shutdown()
    producer = LLM(model, kv_transfer_config=producer_config(transport="mooncake"), **ENGINE_KWARGS)
    consumer = LLM(model, kv_transfer_config=consumer_config(policy="fail", transport="mooncake"), **ENGINE_KWARGS)
    try:
        params = _prefill(producer, prompts)
        assert token_ids(consumer, prompts[:2], [remote_params(value) for value in params[:2]]) == expected[:2]
        connector = consumer.llm_engine.engine_core.executor.worker.kv_connector
        assert connector.mooncake is not None and connector.num_loaded_bytes > 0
        # Negative control: the third prompt's pages zeroed on P change D's tokens.
        for layer_regions in producer.llm_engine.engine_core.executor.worker.kv_connector.regions.regions:
            for region in layer_regions:
                region.zero_()
        assert token_ids(consumer, prompts[2:], [remote_params(params[2])]) != expected[2:]
        assert_all_blocks_free(producer)
        assert_all_blocks_free(consumer)
    finally:
        producer.llm_engine.shutdown()
        consumer.llm_engine.shutdown()


@needs_mooncake
def test_a_zmq_producer_is_refused_by_a_mooncake_consumer(tiny_model_dir, caplog) -> None:
    model = tiny_model_dir("llama")
    producer = LLM(model, kv_transfer_config=producer_config(), **ENGINE_KWARGS)
    consumer = LLM(model, kv_transfer_config=consumer_config(policy="fail", transport="mooncake"), **ENGINE_KWARGS)
    prompt = list(range(5, 45))
    try:
        params = _prefill(producer, [prompt])
        with caplog.at_level(logging.ERROR, logger="pagedserve.kv_transfer.pull_connector_worker"):
            failed = consumer.generate([{"prompt_token_ids": prompt}], [remote_params(params[0])], use_tqdm=False)[0]
        assert failed.outputs[0].finish_reason == "error"
        assert "transport: producer zmq, consumer mooncake" in caplog.text
        assert_all_blocks_free(consumer)
    finally:
        producer.llm_engine.shutdown()
        consumer.llm_engine.shutdown()
