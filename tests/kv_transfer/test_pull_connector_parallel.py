"""PullConnector with several worker ranks ('mp' executor): a prefill engine (P) with tensor parallel 2 or pipeline
parallel 2 and decode engines (D) with one worker or with TP 2 give one engine's greedy tokens; every rank serves or
pulls its own KV shard (unequal TP: D's rank copies each P rank's KV heads into its pages, or, D with more ranks, its
heads' slice of P's pages; kv pp: each layer from the P stage holding it); every block ends free on both sides.

The 'mp' executors spawn their worker ranks; they must import this tree, so the test puts it first on PYTHONPATH.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import pytest

from generation_helpers import random_prompts
from pagedserve import LLM, SamplingParams
from test_pull_connector import (ENGINE_KWARGS, GREEDY, assert_all_blocks_free, consumer_config, producer_config,
                                 record_scheduled_tokens, remote_params, token_ids)
from test_pull_connector_data_parallel import free_port_pair

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def this_tree_on_pythonpath(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 'mp' executors' spawned ranks import pagedserve from this tree."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]))


def check_pd(model: str, producer_parallel: dict[str, Any], consumers: list[dict[str, Any]], seed: int,
             kv_port: int = 0, **extra: Any) -> None:
    """P with `producer_parallel` (over 'mp', the default for several ranks); one D per entry of `consumers` (its
    parallel knobs) pulls the same prompts' KV: greedy tokens equal one engine's; an in-process D computes only each
    prompt's last token. `kv_port`: P's (its worker rank w serves on kv_port + w; 0: free ports); `extra`: both
    sides' kv_connector_extra_config."""
    prompts = random_prompts(2, 20, 40, seed=seed)
    reference_engine = LLM(model, **ENGINE_KWARGS)
    expected = token_ids(reference_engine, prompts, GREEDY)
    reference_engine.llm_engine.shutdown()
    # P in the test's process: its worker ranks (spawned processes) serve the blocks from their own threads, and
    # the test steps P (assert_all_blocks_free) for the done notices to free them.
    producer = LLM(model, kv_transfer_config=producer_config(**extra) | {"kv_port": kv_port}, **producer_parallel,
                   **ENGINE_KWARGS)
    prefill = SamplingParams(temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    try:
        for consumer_parallel in consumers:
            params = [output.kv_transfer_params for output in producer.generate(
                [{"prompt_token_ids": prompt} for prompt in prompts], prefill, use_tqdm=False)]
            if producer_parallel:
                # Each P rank reported its own block server port: the worker ranks run this tree's WorkerReady.
                ports = params[0]["remote_ports"]
                assert len(ports) == 2 and len(set(ports)) == 2 and 0 not in ports
                if kv_port:
                    assert ports == [kv_port, kv_port + 1]
            consumer = LLM(model, kv_transfer_config=consumer_config(policy="fail", **extra), **consumer_parallel,
                           **ENGINE_KWARGS)
            try:
                is_in_process = not consumer_parallel
                scheduled = record_scheduled_tokens(consumer) if is_in_process else {}
                assert token_ids(consumer, prompts, [remote_params(item) for item in params]) == expected
                if is_in_process:
                    # The prompt came from P's ranks: D's first step of each request computed one token.
                    assert sorted(steps[0] for steps in scheduled.values()) == [1, 1]
                assert_all_blocks_free(consumer, timeout_s=30)
            finally:
                consumer.llm_engine.shutdown()
            # Freed once every P rank heard D's done notice (P's executor aggregates the ranks' reports).
            assert_all_blocks_free(producer, timeout_s=30)
    finally:
        producer.llm_engine.shutdown()


def test_tensor_parallel_producer(tiny_model_dir, this_tree_on_pythonpath) -> None:  # type: ignore[no-untyped-def]
    """Unequal TP: P TP=2 -> D TP=1 (each P rank holds one of the two KV heads: D copies both into its pages; P's
    executor aggregates both ranks' reports before its blocks are freed). P's kv_port is set: its TP rank r serves
    on kv_port + r."""
    check_pd(tiny_model_dir("llama"), {"tensor_parallel_size": 2}, [{}], seed=21, kv_port=free_port_pair())


# The consumer's worker ranks add the step metadata's decoding (test_kv_pull_plan.py), the equal-TP plan
# (test_kv_pull_plan.py) and the consumer-side aggregation (KVOutputAggregator, as on P): covered more cheaply.
@pytest.mark.slow
def test_tensor_parallel_producer_and_consumer(tiny_model_dir, this_tree_on_pythonpath) -> None:  # type: ignore[no-untyped-def]
    """Equal TP: P TP=2 -> D TP=2 ('mp'): D's rank r pulls P's rank r; then D TP=1 from the same P."""
    check_pd(tiny_model_dir("llama"), {"tensor_parallel_size": 2},
             [{"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}, {}], seed=24)


def test_tensor_parallel_consumer(tiny_model_dir, this_tree_on_pythonpath) -> None:  # type: ignore[no-untyped-def]
    """Unequal TP, D with more ranks: P TP=1 -> D TP=2 ('mp'): each D rank copies its KV head out of P's two-head
    pages; P frees the blocks once both D ranks told it they are done (num_readers 2)."""
    check_pd(tiny_model_dir("llama"), {}, [{"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}],
             seed=29)


@pytest.mark.slow  # test_kv_pull_plan.py covers the replicated-cache plan, the dense test above the multi-rank path
def test_tensor_parallel_consumer_mla(tiny_model_dir, this_tree_on_pythonpath) -> None:  # type: ignore[no-untyped-def]
    """MLA, P TP=1 -> D TP=2: every D rank reads P's replicated latent pages whole."""
    check_pd(tiny_model_dir("deepseek-v3"), {}, [{"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}],
             seed=30)


@pytest.mark.slow  # test_connector_with_engine_features.py covers async scheduling, the test above D TP=2
def test_async_scheduling_over_several_ranks(tiny_model_dir, this_tree_on_pythonpath) -> None:  # type: ignore[no-untyped-def]
    """P TP=2 -> D TP=2 ('mp'), both scheduling one step ahead: every rank's reports reach the scheduler through
    the executor's aggregation while the next step is queued."""
    check_pd(tiny_model_dir("llama"), {"tensor_parallel_size": 2, "async_scheduling": True},
             [{"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "async_scheduling": True}], seed=32)


def test_pipeline_parallel_producer(tiny_model_dir, this_tree_on_pythonpath) -> None:  # type: ignore[no-untyped-def]
    """kv pp: P PP=2 (a layer on each stage) -> D PP=1 pulls each layer from the P stage that holds it."""
    check_pd(tiny_model_dir("llama"), {"pipeline_parallel_size": 2}, [{}], seed=22)


@pytest.mark.slow  # test_kv_pull_plan.py covers the replicated-cache choice, the TP test the multi-rank path
def test_tensor_parallel_producer_mla(tiny_model_dir, this_tree_on_pythonpath) -> None:  # type: ignore[no-untyped-def]
    """MLA latents are whole on every P rank: D TP=1 reads P rank 0's and tells both ranks it is done."""
    check_pd(tiny_model_dir("deepseek-v3"), {"tensor_parallel_size": 2}, [{}], seed=23)


@pytest.mark.slow  # test_kv_pull_plan.py covers the stages' plan, the P PP=2 test the batch queue's empty steps
def test_pipeline_parallel_consumer(tiny_model_dir, this_tree_on_pythonpath) -> None:  # type: ignore[no-untyped-def]
    """P PP=1 -> D PP=2: each D stage pulls its layer from P's one rank, which frees the blocks once both stages
    told it they are done (num_readers 2); D waits for its loads in the batch queue's empty steps."""
    check_pd(tiny_model_dir("llama"), {}, [{"pipeline_parallel_size": 2}], seed=28)


@pytest.mark.slow  # the mooncake transport's single-rank tests and the zmq kv pp test cover its parts
def test_mooncake_transport_with_several_producer_ranks(tiny_model_dir, this_tree_on_pythonpath,  # type: ignore[no-untyped-def]
                                                        caplog) -> None:
    """kv pp over mooncake: D reads each layer's regions from the P stage holding it, cache to cache. Unequal TP
    over mooncake (head slices are not whole pages) fails the load, saying that it needs zmq."""
    pytest.importorskip("mooncake.engine")
    model = tiny_model_dir("llama")
    check_pd(model, {"pipeline_parallel_size": 2}, [{}], seed=26, transport="mooncake")
    producer = LLM(model, kv_transfer_config=producer_config(transport="mooncake"),
                   distributed_executor_backend="mp", tensor_parallel_size=2, **ENGINE_KWARGS)
    consumer = LLM(model, kv_transfer_config=consumer_config(policy="fail", transport="mooncake"), **ENGINE_KWARGS)
    prefill = SamplingParams(temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    try:
        prompt = random_prompts(1, 20, 30, seed=27)[0]
        (output,) = producer.generate([{"prompt_token_ids": prompt}], prefill, use_tqdm=False)
        with caplog.at_level(logging.ERROR):
            (result,) = consumer.generate([{"prompt_token_ids": prompt}], remote_params(output.kv_transfer_params),
                                          use_tqdm=False)
        assert result.outputs[0].finish_reason == "error"
        assert "transport 'mooncake' reads whole pages" in caplog.text
        assert_all_blocks_free(consumer, timeout_s=30)
        assert_all_blocks_free(producer, timeout_s=30)
    finally:
        producer.llm_engine.shutdown()
        consumer.llm_engine.shutdown()
