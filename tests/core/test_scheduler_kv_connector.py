"""The scheduler with the PullConnector's scheduler side and fabricated worker reports: exact block ids, states and
orders for remote prefill (consumer) and held blocks (producer)."""
from __future__ import annotations

from pagedserve.config.kv_transfer import KVTransferConfig
from pagedserve.config.scheduler import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.scheduler_output import KVConnectorOutput
from pagedserve.kv_transfer.pull_connector_scheduler import PullConnectorScheduler

BLOCK_SIZE = 4
REMOTE = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_host": "127.0.0.1", "remote_port": 5600,
          "remote_block_ids": [11, 12, 13, 14], "remote_request_id": "p-req"}


def connector_scheduler(role: str, policy: str = "recompute", num_blocks: int = 32,
                        async_scheduling: bool = False) -> Scheduler:
    config = KVTransferConfig(kv_connector="PullConnector", kv_role=role, engine_id="e0",
                              kv_load_failure_policy=policy)
    connector = PullConnectorScheduler(config, BLOCK_SIZE, "127.0.0.1", [5600])
    return Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64, async_scheduling=async_scheduling),
                     KVCacheManager(num_blocks, BLOCK_SIZE, True), BLOCK_SIZE, kv_connector=connector,
                     kv_load_failure_policy=policy)


def run(scheduler: Scheduler, model_output, connector_output: KVConnectorOutput | None = None):  # type: ignore[no-untyped-def]
    scheduler_output = scheduler.schedule()
    output = model_output(scheduler, scheduler_output)
    output.kv_connector_output = connector_output
    return scheduler_output, scheduler.update_from_output(scheduler_output, output)


def test_remote_prefill_waits_with_its_blocks_then_computes_the_last_token(make_request, model_output) -> None:
    scheduler = connector_scheduler("kv_consumer")
    prompt = list(range(100, 114))  # 14 tokens: 4 blocks
    scheduler.add_request(make_request("local", prompt[:9], max_tokens=1))
    run(scheduler, model_output)  # computes 9 tokens locally: 2 full blocks cached (ids 1, 2)
    run(scheduler, model_output)
    scheduler.add_request(make_request("d", prompt, max_tokens=3, extra_args={"kv_transfer_params": REMOTE}))

    first, outputs = run(scheduler, model_output)
    request = scheduler.remote_kv_requests["d"]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and first.num_scheduled_tokens == {}
    assert outputs == []
    assert scheduler.kv_cache_manager.get_block_ids("d") == [1, 2, 4, 5]  # hit [1, 2], new [4, 5]
    assert request.num_computed_tokens == 8 and request.num_cached_tokens == 8
    (order,) = first.kv_connector_metadata.loads
    assert (order.local_block_ids, order.remote_block_ids, order.remote_request_id) == ([4, 5], [13, 14], "p-req")
    # The blocks being loaded are not in the prefix cache yet: a twin prompt hits only the local blocks.
    twin = make_request("twin", prompt)
    assert scheduler.kv_cache_manager.get_computed_blocks(twin)[1] == 8

    waiting, _ = run(scheduler, model_output)  # the load has not ended: nothing to do
    assert waiting.num_scheduled_tokens == {} and waiting.kv_connector_metadata.loads == []
    _, outputs = run(scheduler, model_output, KVConnectorOutput(finished_recving={"d"}))
    assert outputs == [] and scheduler.waiting.peek_request() is request and request.num_computed_tokens == 13
    resumed, outputs = run(scheduler, model_output)
    assert resumed.num_scheduled_tokens == {"d": 1}
    (new,) = resumed.scheduled_new_requests
    assert (new.block_ids, new.num_computed_tokens) == ([1, 2, 4, 5], 13)
    assert [output.new_token_ids for output in outputs] == [[7]]
    assert scheduler.kv_cache_manager.get_computed_blocks(make_request("twin2", prompt))[1] == 12


def test_failed_load_recomputes_or_fails(make_request, model_output) -> None:
    prompt = list(range(200, 214))
    recomputing = connector_scheduler("kv_consumer", "recompute")
    recomputing.add_request(make_request("d", prompt, max_tokens=2, extra_args={"kv_transfer_params": REMOTE}))
    run(recomputing, model_output)
    run(recomputing, model_output, KVConnectorOutput(finished_recving={"d"}, invalid_block_ids={1, 2, 3, 4}))
    resumed, _ = run(recomputing, model_output)
    assert resumed.num_scheduled_tokens == {"d": 14}  # the whole prompt, computed here

    failing = connector_scheduler("kv_consumer", "fail")
    failing.add_request(make_request("d", prompt, max_tokens=2, extra_args={"kv_transfer_params": REMOTE}))
    run(failing, model_output)
    _, outputs = run(failing, model_output, KVConnectorOutput(finished_recving={"d"}, invalid_block_ids={3}))
    assert [(output.request_id, output.finish_reason) for output in outputs] == [("d", "error")]
    assert not failing.has_unfinished_requests() and not failing.has_kv_held_requests()
    assert failing.kv_cache_manager.num_free_blocks == 31


def test_abort_during_load_keeps_blocks_until_the_load_ends(make_request, model_output) -> None:
    scheduler = connector_scheduler("kv_consumer")
    scheduler.add_request(make_request("d", list(range(14)), extra_args={"kv_transfer_params": REMOTE}))
    run(scheduler, model_output)
    scheduler.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert scheduler.has_kv_held_requests() and scheduler.kv_cache_manager.num_free_blocks == 27
    cancelled, _ = run(scheduler, model_output)
    assert cancelled.kv_connector_metadata.finished_request_ids == ["d"]  # the worker cancels the load
    run(scheduler, model_output, KVConnectorOutput(finished_recving={"d"}, invalid_block_ids={1, 2, 3, 4}))
    assert not scheduler.has_kv_held_requests() and scheduler.kv_cache_manager.num_free_blocks == 31


def test_producer_holds_blocks_until_the_consumer_is_done(make_request, model_output) -> None:
    scheduler = connector_scheduler("kv_producer")
    scheduler.add_request(make_request("p", list(range(10)), max_tokens=1,
                                       extra_args={"kv_transfer_params": {"do_remote_decode": True}}))
    scheduler.add_request(make_request("aborted", list(range(50, 60)), max_tokens=1,
                                       extra_args={"kv_transfer_params": {"do_remote_decode": True}}))
    scheduler.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)  # not held: nobody will pull it
    _, outputs = run(scheduler, model_output)
    (output,) = outputs
    assert output.finish_reason == "length"
    assert output.kv_transfer_params == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e0", "remote_host": "127.0.0.1",
        "remote_port": 5600, "remote_block_ids": [1, 2, 3], "remote_request_id": "p"}
    assert scheduler.has_kv_held_requests() and scheduler.kv_cache_manager.num_free_blocks == 28
    registered, _ = run(scheduler, model_output)
    assert registered.kv_connector_metadata.sends == ["p"]
    run(scheduler, model_output, KVConnectorOutput(finished_sending={"p", "unknown"}))
    assert not scheduler.has_kv_held_requests() and scheduler.kv_cache_manager.num_free_blocks == 31


def test_remote_prefill_that_does_not_fit_waits_and_loads_later(make_request, model_output) -> None:
    scheduler = connector_scheduler("kv_consumer", num_blocks=5)  # 4 usable blocks
    scheduler.add_request(make_request("a", list(range(50, 62)), max_tokens=1))  # 3 blocks
    scheduler.add_request(make_request("d", list(range(14)), max_tokens=2, extra_args={"kv_transfer_params": REMOTE}))
    first, _ = run(scheduler, model_output)
    assert first.num_scheduled_tokens == {"a": 12} and first.kv_connector_metadata.loads == []
    assert scheduler.waiting.peek_request().request_id == "d" and not scheduler.remote_kv_requests
    second, _ = run(scheduler, model_output)  # "a" finished: its blocks are free again
    (order,) = second.kv_connector_metadata.loads
    assert order.request_id == "d" and len(order.local_block_ids) == 4
    assert scheduler.remote_kv_requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_multi_connector_routes_each_request_to_one_part(make_request, model_output) -> None:
    """MultiConnector of a producer part and a consumer part: a remote prefill is loaded by the consumer part
    only; a do_remote_decode request is held by the producer part and returns its kv_transfer_params."""
    from pagedserve.kv_transfer.multi_connector import MultiConnectorScheduler

    config = KVTransferConfig.parse({"kv_connector": "MultiConnector", "kv_role": "kv_both", "engine_id": "m",
                                     "kv_connector_extra_config": {"connectors": [
                                         {"kv_connector": "PullConnector", "kv_role": "kv_producer"},
                                         {"kv_connector": "PullConnector", "kv_role": "kv_consumer"}]}})
    assert config is not None
    parts = [PullConnectorScheduler(part, BLOCK_SIZE, "127.0.0.1", [5600]) for part in config.connector_configs]
    scheduler = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64),
                          KVCacheManager(32, BLOCK_SIZE, True), BLOCK_SIZE, kv_connector=MultiConnectorScheduler(parts))
    scheduler.add_request(make_request("d", list(range(14)), extra_args={"kv_transfer_params": REMOTE}))
    scheduler.add_request(make_request("p", list(range(30, 40)), max_tokens=1,
                                       extra_args={"kv_transfer_params": {"do_remote_decode": True}}))
    first, outputs = run(scheduler, model_output)
    producer_metadata, consumer_metadata = first.kv_connector_metadata
    assert producer_metadata.loads == [] and [order.request_id for order in consumer_metadata.loads] == ["d"]
    (output,) = outputs
    assert output.request_id == "p" and output.kv_transfer_params["remote_engine_id"] == "m-0"
    assert scheduler.has_kv_held_requests() and "d" in scheduler.remote_kv_requests
    run(scheduler, model_output, KVConnectorOutput(finished_sending={"p"}, finished_recving={"d"}))
    assert not scheduler.has_kv_held_requests() and not scheduler.remote_kv_requests


def test_async_scheduling_with_steps_in_flight(make_request) -> None:
    """Each step is scheduled before the previous one's output is back (the engine's batch queue): "a" decodes ahead
    on placeholders while "d" waits for its load and "p" is held for a consumer. "p" gets no step past its one
    token; "d" joins only the step scheduled after the output reporting its load, with the blocks it was parked
    with and one token to compute; "p"'s blocks are freed by the report of its send, and every block ends free."""
    from test_async_scheduler import sampled_output, schedule_noting_samplers

    scheduler = connector_scheduler("kv_both", async_scheduling=True)
    scheduler.add_request(make_request("a", list(range(50, 55)), max_tokens=6))
    scheduler.add_request(make_request("d", list(range(14)), max_tokens=3, extra_args={"kv_transfer_params": REMOTE}))
    scheduler.add_request(make_request("p", list(range(30, 40)), max_tokens=1,
                                       extra_args={"kv_transfer_params": {"do_remote_decode": True}}))
    step0, samplers0 = schedule_noting_samplers(scheduler)
    assert step0.num_scheduled_tokens == {"a": 5, "p": 10} and samplers0 == {"a", "p"}
    (order,) = step0.kv_connector_metadata.loads
    parked_block_ids = scheduler.kv_cache_manager.get_block_ids("d")
    assert order.local_block_ids == parked_block_ids and len(parked_block_ids) == 4

    step1, samplers1 = schedule_noting_samplers(scheduler)  # step 0 in flight
    assert step1.num_scheduled_tokens == {"a": 1}  # "p" has its one token on the way; "d" still loads
    outputs = scheduler.update_from_output(step0, sampled_output(step0, samplers0))
    (held,) = [output for output in outputs if output.request_id == "p"]
    assert held.finish_reason == "length" and held.kv_transfer_params["remote_block_ids"]
    assert scheduler.has_kv_held_requests()

    step2, samplers2 = schedule_noting_samplers(scheduler)  # step 1 in flight
    assert step2.num_scheduled_tokens == {"a": 1} and step2.kv_connector_metadata.sends == ["p"]
    output1 = sampled_output(step1, samplers1)
    output1.kv_connector_output = KVConnectorOutput(finished_recving={"d"})
    scheduler.update_from_output(step1, output1)
    assert scheduler.waiting.peek_request().request_id == "d"

    step3, samplers3 = schedule_noting_samplers(scheduler)  # step 2 in flight
    assert step3.num_scheduled_tokens == {"a": 1, "d": 1} and samplers3 == {"a", "d"}
    (new,) = step3.scheduled_new_requests
    assert (new.block_ids, new.num_computed_tokens) == (parked_block_ids, 13)
    output2 = sampled_output(step2, samplers2)
    output2.kv_connector_output = KVConnectorOutput(finished_sending={"p"})
    scheduler.update_from_output(step2, output2)
    assert not scheduler.has_kv_held_requests()

    in_flight, samplers = step3, samplers3
    for _ in range(20):
        if not scheduler.has_unfinished_requests():
            break
        following, following_samplers = schedule_noting_samplers(scheduler)
        scheduler.update_from_output(in_flight, sampled_output(in_flight, samplers))
        in_flight, samplers = following, following_samplers
    scheduler.update_from_output(in_flight, sampled_output(in_flight, samplers))
    assert not scheduler.has_unfinished_requests() and not scheduler.has_kv_held_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == 31
