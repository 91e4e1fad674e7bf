"""PullConnector in push mode: D reserves its blocks first, P (its own process) sends each layer's KV as its forward
writes it; D's greedy tokens equal one engine's, D computes only each prompt's last token, and faults (P silent, P
killed, D's request aborted) follow kv_load_failure_policy with every block free.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from generation_helpers import random_prompts
from pagedserve import LLM, SamplingParams
from pagedserve.kv_transfer.kv_transfer_info import KVTransferInfo
from pagedserve.kv_transfer.push_producer_rank import push_producer_rank
from pagedserve.proxy.kv_transfer_mode import push_kv_transfer_params
from test_pull_connector import (ENGINE_KWARGS, GREEDY, PrefillProcess, assert_all_blocks_free,
                                 assert_producer_blocks_free, record_scheduled_tokens, token_ids)
from test_pull_connector_data_parallel import record_first_steps

PUSH = {"mode": "push"}


def push_params(port: int, producer_request_id: str) -> SamplingParams:
    """D's kv_transfer_params in push mode: P's address and the id P will run the request under (no blocks yet)."""
    return SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True, extra_args={
        "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "prefill", "remote_host": "127.0.0.1",
                               "remote_port": port, "remote_block_ids": [], "remote_request_id": producer_request_id}})


def consumer_config(policy: str, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "PullConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": policy,
            "kv_connector_extra_config": PUSH | extra}


def start_producer(model: str, **extra: Any) -> tuple[PrefillProcess, int]:
    producer = PrefillProcess(model, kv_transfer_config={
        "kv_connector": "PullConnector", "kv_role": "kv_producer", "engine_id": "prefill",
        "kv_connector_extra_config": PUSH | extra}, max_num_batched_tokens=16, **ENGINE_KWARGS)
    return producer, producer.port


def num_waiting_orders(producer: PrefillProcess) -> int:
    return producer.ask(op="push_stats")["num_waiting_orders"]


def wait_for_orders(producer: PrefillProcess, count: int, timeout_s: float = 20.0) -> None:
    """Until P holds `count` push orders waiting for their requests (D's receiver sent them)."""
    deadline = time.monotonic() + timeout_s
    while num_waiting_orders(producer) < count:
        assert time.monotonic() < deadline, "the consumer's push orders did not reach the producer"
        time.sleep(0.02)


def run_until_done(llm: LLM, timeout_s: float = 60.0) -> dict[str, Any]:
    """Steps the engine until no request is left; the finished outputs by request id."""
    engine = llm.llm_engine
    finished: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        time.sleep(0.002)
    return finished


@pytest.fixture(scope="module", params=["llama", pytest.param("deepseek-v3", marks=pytest.mark.slow),
                                        pytest.param("deepseek-v32", marks=pytest.mark.slow)])
def model_dir(request: pytest.FixtureRequest, tiny_model_dir) -> str:  # type: ignore[no-untyped-def]
    return tiny_model_dir(request.param)


def test_push_greedy_equals_one_engine(model_dir: str) -> None:
    """Chunked prefill on P (16-token budget). Two requests reach D first: P streams their layers from the forward
    (layer sends), past a local prefix hit on D for one; a third P computed before D asked: P sends it at once
    (catch-up). D's tokens equal one engine's,
    D computes one prompt token per request, and every block ends free on both sides."""
    prompts = random_prompts(3, 40, 70, seed=21)
    reference_engine = LLM(model_dir, **ENGINE_KWARGS)
    expected = token_ids(reference_engine, prompts, GREEDY)
    reference_engine.llm_engine.shutdown()
    producer, port = start_producer(model_dir)
    consumer = LLM(model_dir, kv_transfer_config=consumer_config("fail"), **ENGINE_KWARGS)
    engine = consumer.llm_engine
    try:
        # The third prompt is computed on P first; P holds its blocks until D's order comes.
        producer.ask(op="submit", requests=[{"request_id": "p2", "prompt": prompts[2]}])
        deadline = time.monotonic() + 30
        while producer.ask(op="blocks")["num_held"] != 1:
            assert time.monotonic() < deadline, "the producer did not finish its request"
            time.sleep(0.05)
        # D computed a prefix of the first prompt before: its two full blocks are a local hit, P sends the rest.
        token_ids(consumer, [prompts[0][:40]], SamplingParams(temperature=0, max_tokens=1))
        scheduled = record_scheduled_tokens(consumer)
        for index in range(2):
            engine.add_request(f"d{index}", {"prompt_token_ids": prompts[index]}, push_params(port, f"p{index}"))
        engine.step()  # parks them (WAITING_FOR_REMOTE_KVS) and hands their orders to the receiver
        wait_for_orders(producer, 2)
        producer.ask(op="submit", requests=[{"request_id": f"p{index}", "prompt": prompts[index]}
                                            for index in range(2)])
        engine.add_request("d2", {"prompt_token_ids": prompts[2]}, push_params(port, "p2"))
        finished = run_until_done(consumer)
        outputs = [finished[f"d{index}"] for index in range(3)]
        assert [output.outputs[0].token_ids for output in outputs] == expected
        assert all(output.outputs[0].finish_reason == "length" for output in outputs)
        assert sorted(steps[0] for steps in scheduled.values()) == [1, 1, 1]
        assert outputs[0].num_cached_tokens == 32  # the local hit on D
        stats = producer.ask(op="push_stats")
        assert stats["num_layer_sends"] > 0 and stats["num_catch_up_sends"] > 0, stats
        assert_all_blocks_free(consumer)
        assert_producer_blocks_free(producer)
    finally:
        producer.close()
        engine.shutdown()


def test_push_faults_follow_the_policy(tiny_model_dir, caplog) -> None:  # type: ignore[no-untyped-def]
    """A P that never runs the request and a P killed after taking the order: D's load times out
    (transfer_timeout_s) and D recomputes (same tokens) or fails ('fail'); a request aborted on P: P says so and D
    recomputes; a request aborted on D while it waits frees its blocks; every D block ends free."""
    model = tiny_model_dir("llama")
    prompts = random_prompts(3, 30, 45, seed=23)
    reference_engine = LLM(model, **ENGINE_KWARGS)
    expected = token_ids(reference_engine, prompts, GREEDY)
    reference_engine.llm_engine.shutdown()
    producer, port = start_producer(model)
    recomputing = LLM(model, kv_transfer_config=consumer_config("recompute", transfer_timeout_s=1.5),
                      **ENGINE_KWARGS)
    failing = LLM(model, kv_transfer_config=consumer_config("fail", transfer_timeout_s=1.5), **ENGINE_KWARGS)
    try:
        # Never sent: P keeps the order waiting, D gives up after transfer_timeout_s and computes the prompt.
        start = time.monotonic()
        recomputing.llm_engine.add_request("never", {"prompt_token_ids": prompts[0]}, push_params(port, "nobody"))
        # Aborted while it waits: its blocks are freed once the receiver drops the load.
        recomputing.llm_engine.add_request("aborted", {"prompt_token_ids": prompts[1]}, push_params(port, "x"))
        recomputing.llm_engine.step()
        wait_for_orders(producer, 2)
        recomputing.llm_engine.abort_request(["aborted"])
        finished = run_until_done(recomputing)
        assert finished["never"].outputs[0].token_ids == expected[0]
        assert time.monotonic() - start >= 1.5
        assert_all_blocks_free(recomputing)
        assert producer.ask(op="blocks", wait_s=0)["num_held"] == 0

        # Aborted on P before it ran: P tells D at once ("failed"), D recomputes.
        waiting = num_waiting_orders(producer)  # the order for "nobody" still waits on P ("x" too, until P steps)
        recomputing.llm_engine.add_request("p-aborted", {"prompt_token_ids": prompts[1]},
                                           push_params(port, "p-abort"))
        recomputing.llm_engine.step()
        wait_for_orders(producer, waiting + 1)
        with caplog.at_level(logging.ERROR, logger="pagedserve.kv_transfer.push_connector_worker"):
            producer.ask(op="submit", requests=[{"request_id": "p-abort", "prompt": prompts[1]}], abort=True)
            finished = run_until_done(recomputing)
        assert finished["p-aborted"].outputs[0].token_ids == expected[1]
        assert "the producer gave up: the producer's request 'p-abort' ended without its KV" in caplog.text
        assert_all_blocks_free(recomputing)
        assert producer.ask(op="blocks", wait_s=0)["num_held"] == 0

        # Killed after taking the order: nothing comes, the request fails.
        waiting = num_waiting_orders(producer)
        failing.llm_engine.add_request("killed", {"prompt_token_ids": prompts[2]}, push_params(port, "p-killed"))
        failing.llm_engine.step()
        wait_for_orders(producer, waiting + 1)
        producer.kill()
        finished = run_until_done(failing)
        assert finished["killed"].outputs[0].finish_reason == "error"
        assert finished["killed"].outputs[0].token_ids == []
        assert_all_blocks_free(failing)
        assert token_ids(failing, prompts[2:], GREEDY) == expected[2:]  # D keeps serving
    finally:
        producer.close()
        recomputing.llm_engine.shutdown()
        failing.llm_engine.shutdown()


def test_push_with_two_data_parallel_ranks_on_both_sides(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """P and D with data_parallel_size 2 in push mode. P runs each request on the rank its id names
    (push_producer_rank); D's kv_transfer_params name that rank, as the push-mode proxy builds them; each request's
    D rank (its coordinator's choice) reserves its blocks and sends that P rank its own push order. Greedy tokens
    equal one engine's, both P ranks stream layers, each D rank computes one prompt token per request it got,
    every block ends free on every rank of both sides."""
    model = tiny_model_dir("llama")
    prompts = random_prompts(4, 30, 50, seed=27)
    # Ranks 0, 0, 1, 1 by id: P's least-loaded routing would give 0, 1, 0, 1 (two orders at the wrong rank).
    producer_ids = ["p4", "p5", "p6", "p7"]
    assert [push_producer_rank(request_id, 2) for request_id in producer_ids] == [0, 0, 1, 1]
    reference_engine = LLM(model, **ENGINE_KWARGS)
    expected = token_ids(reference_engine, prompts, GREEDY)
    reference_engine.llm_engine.shutdown()
    producer = PrefillProcess(model, kv_transfer_config={
        "kv_connector": "PullConnector", "kv_role": "kv_producer", "engine_id": "prefill",
        "kv_connector_extra_config": PUSH}, data_parallel_size=2, max_num_batched_tokens=16, **ENGINE_KWARGS)
    consumer = LLM(model, data_parallel_size=2, kv_transfer_config=consumer_config("fail"), **ENGINE_KWARGS)
    engine = consumer.llm_engine
    try:
        assert [rank["engine_id"] for rank in producer.data_parallel_ranks] == ["prefill_dp0", "prefill_dp1"]
        info = KVTransferInfo(kv_connector="PullConnector", kv_role="kv_producer", mode="push",
                              engine_id="prefill_dp0", host="127.0.0.1", ports=producer.data_parallel_ranks[0]["ports"],
                              data_parallel_ranks=producer.data_parallel_ranks)
        first_steps = record_first_steps(consumer)
        for index, prompt in enumerate(prompts):
            params = push_kv_transfer_params(info, producer_ids[index])
            rank = producer.data_parallel_ranks[push_producer_rank(producer_ids[index], 2)]
            assert (params["remote_engine_id"], params["remote_port"]) == (rank["engine_id"], rank["ports"][0])
            engine.add_request(f"d{index}", {"prompt_token_ids": prompt}, SamplingParams(
                temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True,
                extra_args={"kv_transfer_params": params}))
        engine.step()  # each D rank parks its requests and hands their orders to its receiver
        wait_for_orders(producer, len(prompts))
        producer.ask(op="submit", requests=[{"request_id": request_id, "prompt": prompt}
                                            for request_id, prompt in zip(producer_ids, prompts)])
        finished = run_until_done(consumer)
        assert [finished[f"d{index}"].outputs[0].token_ids for index in range(len(prompts))] == expected
        assert engine.engine_core.requests_routed_per_rank == [2, 2]
        assert [sorted(rank_steps.values()) for rank_steps in first_steps] == [[1, 1], [1, 1]]
        stats = producer.ask(op="push_stats")
        assert all(count > 0 for count in stats["num_layer_sends_per_rank"]), stats
        assert_all_blocks_free(consumer, timeout_s=30)
        assert_producer_blocks_free(producer)
    finally:
        producer.close()
        engine.shutdown()


def test_push_consumer_refuses_a_pull_producer(tiny_model_dir, caplog) -> None:  # type: ignore[no-untyped-def]
    """D in push mode, P in pull mode: the handshake names both modes, the request fails ('fail'), blocks free."""
    model = tiny_model_dir("llama")
    producer = LLM(model, kv_transfer_config={"kv_connector": "PullConnector", "kv_role": "kv_producer"},
                   **ENGINE_KWARGS)
    consumer = LLM(model, kv_transfer_config=consumer_config("fail"), **ENGINE_KWARGS)
    try:
        port = producer.llm_engine.engine_core.runtime_info.kv_transfer_port
        with caplog.at_level(logging.ERROR, logger="pagedserve.kv_transfer.push_connector_worker"):
            failed = consumer.generate([{"prompt_token_ids": list(range(5, 45))}], [push_params(port, "p")],
                                       use_tqdm=False)[0]
        assert failed.outputs[0].finish_reason == "error"
        assert "runs kv_connector_extra_config.mode='pull'; this consumer's mode='push' needs the producer in mode " \
               "'push' too" in caplog.text
        assert_all_blocks_free(consumer)
    finally:
        producer.llm_engine.shutdown()
        consumer.llm_engine.shutdown()


def test_producer_save_orders_follow_the_chunks() -> None:
    """P's scheduler side on fabricated steps: one SaveOrder per step that computes prompt tokens of a
    do_remote_decode request (its blocks so far, tokens before and after), none for other requests or the
    sampled token, and a preempted request starts again from its new blocks."""
    from pagedserve.config.kv_transfer import KVTransferConfig
    from pagedserve.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
    from pagedserve.kv_transfer.push_connector_scheduler import PushConnectorScheduler, SaveOrder

    config = KVTransferConfig(kv_connector="PullConnector", kv_role="kv_producer",
                              kv_connector_extra_config={"mode": "push"})
    scheduler = PushConnectorScheduler(config, 16, "127.0.0.1", [5600])
    remote = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})

    def step(new: list[NewRequestData], cached: CachedRequestData, scheduled: dict[str, int],
             preempted: set[str] | None = None) -> list[SaveOrder]:
        output = SchedulerOutput(scheduled_new_requests=new, scheduled_cached_requests=cached,
                                 num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                                 preempted_request_ids=preempted or set())
        return scheduler.build_connector_meta(output).saves

    prompt = list(range(40))
    assert step([NewRequestData("p", prompt, 40, remote, [3], 0),
                 NewRequestData("plain", prompt, 40, SamplingParams(max_tokens=4), [9], 0)],
                CachedRequestData(), {"p": 16, "plain": 16}) == [SaveOrder("p", [3], 0, 16, 40)]
    assert step([], CachedRequestData(["p", "plain"], [[4], [10]], [16, 16]), {"p": 16, "plain": 16}) \
        == [SaveOrder("p", [3, 4], 16, 32, 40)]
    (last,) = step([], CachedRequestData(["p"], [[5]], [32]), {"p": 8})
    assert last == SaveOrder("p", [3, 4, 5], 32, 40, 40) and last.completes_prompt
    assert step([], CachedRequestData(["p"], [[]], [40]), {"p": 1}) == []  # the sampled token stays on P
    # Preempted, then scheduled again from scratch in other blocks (a prefix hit of one block).
    assert step([], CachedRequestData(), {}, preempted={"p"}) == []
    assert step([NewRequestData("p", prompt, 40, remote, [7, 8], 16)], CachedRequestData(), {"p": 16}) \
        == [SaveOrder("p", [7, 8], 16, 32, 40)]


def test_push_metadata_through_the_worker_pipe() -> None:
    """An 'mp' worker gets the push mode's orders as plain maps: the worker side turns them back (SaveOrders
    included) and takes the step's saves."""
    from pagedserve.config.kv_transfer import KVTransferConfig
    from pagedserve.core.scheduler_output import CachedRequestData, SchedulerOutput
    from pagedserve.executor.worker_messages import ExecuteModel, WorkerCodec
    from pagedserve.kv_transfer.push_connector_scheduler import PushConnectorMetadata, SaveOrder
    from pagedserve.kv_transfer.push_connector_worker import PushConnectorWorker

    metadata = PushConnectorMetadata(sends=["s"], saves=[SaveOrder("p", [3, 4], 16, 32, 40)])
    codec = WorkerCodec()
    decoded = codec.decode_to_worker(codec.encode(ExecuteModel(scheduler_output=SchedulerOutput(
        [], CachedRequestData(), {}, 0, kv_connector_metadata=metadata))))
    worker = PushConnectorWorker(KVTransferConfig(kv_connector="PullConnector", kv_role="kv_producer",
                                                  kv_connector_extra_config=PUSH), {"block_size": 16})
    worker.start_load_kv(decoded.scheduler_output.kv_connector_metadata)
    assert worker._step_saves == metadata.saves and set(worker._send_deadlines) == {"s"}
    assert worker._pushed["p"].block_ids == [3, 4] and worker._pushed["p"].num_written_tokens == 16
    worker.wait_for_save()
    assert worker._pushed["p"].num_written_tokens == 32 and not worker._pushed["p"].is_prefilled
    worker.shutdown()
