"""Async scheduling in the scheduler: placeholders for tokens sampled by steps still in flight.

Steps are scheduled before the previous step's output comes back; outputs are fabricated here and
applied in submission order, as the engine's batch queue does.
"""
from __future__ import annotations

from pagedserve.core.request import RequestStatus
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

EOS = 2


def sampled_output(scheduler_output: SchedulerOutput, sampling_ids: set[str], token_id: int = 7,
                   tokens: dict[str, int] | None = None) -> ModelRunnerOutput:
    """A model output sampling one token for each request in `sampling_ids` (a worker's answer)."""
    request_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(request_ids=request_ids, sampled_token_ids=[
        [(tokens or {}).get(rid, token_id)] if rid in sampling_ids else [] for rid in request_ids])


def schedule_noting_samplers(scheduler) -> tuple[SchedulerOutput, set[str]]:
    """schedule() plus the ids of the requests whose step samples (their placeholder count grew)."""
    before = {rid: r.num_output_placeholders for rid, r in scheduler.requests.items()}
    output = scheduler.schedule()
    samplers = {rid for rid in output.num_scheduled_tokens
                if scheduler.requests[rid].num_output_placeholders > before.get(rid, 0)}
    return output, samplers


def test_placeholder_bookkeeping(make_scheduler, make_request):
    scheduler = make_scheduler(async_scheduling=True)
    request = make_request("r", [10, 11, 12, 13, 14], max_tokens=8)
    scheduler.add_request(request)

    step0, samplers0 = schedule_noting_samplers(scheduler)  # the prompt; samples the first token
    assert step0.num_scheduled_tokens == {"r": 5} and samplers0 == {"r"}
    assert (request.num_computed_tokens, request.num_output_placeholders) == (5, 1)

    step1, samplers1 = schedule_noting_samplers(scheduler)  # step 0 in flight: decode its placeholder
    assert step1.num_scheduled_tokens == {"r": 1} and samplers1 == {"r"}
    assert step1.scheduled_cached_requests.num_computed_tokens == [5]  # the placeholder's position
    assert (request.num_computed_tokens, request.num_output_placeholders) == (6, 2)

    outputs = scheduler.update_from_output(step0, sampled_output(step0, samplers0, token_id=40))
    assert [o.new_token_ids for o in outputs] == [[40]]
    assert request.output_token_ids == [40] and request.num_output_placeholders == 1

    step2, _ = schedule_noting_samplers(scheduler)
    assert step2.num_scheduled_tokens == {"r": 1}
    assert step2.scheduled_cached_requests.num_computed_tokens == [6]
    scheduler.update_from_output(step1, sampled_output(step1, samplers1, token_id=41))
    assert request.output_token_ids == [40, 41]
    assert (request.num_computed_tokens, request.num_output_placeholders) == (7, 1)
    # Invariant: computed tokens never run past known tokens plus placeholders.
    assert request.num_computed_tokens <= request.num_tokens + request.num_output_placeholders


def test_synchronous_scheduling_never_decodes_ahead(make_scheduler, make_request):
    scheduler = make_scheduler()  # async_scheduling off
    request = make_request("r", [10, 11, 12], max_tokens=8)
    scheduler.add_request(request)
    step0 = scheduler.schedule()
    assert step0.num_scheduled_tokens == {"r": 3}
    # Without the output of step 0 there is nothing to compute (a pipeline stage keeps it in flight).
    assert scheduler.schedule().num_scheduled_tokens == {}
    scheduler.update_from_output(step0, ModelRunnerOutput(["r"], [[7]]))
    assert request.num_output_placeholders == 0
    assert scheduler.schedule().num_scheduled_tokens == {"r": 1}


def test_max_tokens_never_exceeded(make_scheduler, make_request):
    scheduler = make_scheduler(async_scheduling=True)
    request = make_request("r", [10, 11, 12], max_tokens=2)
    scheduler.add_request(request)
    step0, samplers0 = schedule_noting_samplers(scheduler)
    step1, samplers1 = schedule_noting_samplers(scheduler)
    assert step1.num_scheduled_tokens == {"r": 1}
    # Two tokens are on their way: max_tokens is reached, no third step.
    assert scheduler.schedule().num_scheduled_tokens == {}
    scheduler.update_from_output(step0, sampled_output(step0, samplers0))
    assert scheduler.schedule().num_scheduled_tokens == {}
    outputs = scheduler.update_from_output(step1, sampled_output(step1, samplers1))
    assert outputs[-1].finish_reason == "length" and request.output_token_ids == [7, 7]


def test_max_model_len_reached_by_placeholders(make_scheduler, make_request):
    scheduler = make_scheduler(async_scheduling=True, max_model_len=6)
    request = make_request("r", [10, 11, 12, 13], max_tokens=50)
    scheduler.add_request(request)
    steps = [schedule_noting_samplers(scheduler) for _ in range(3)]
    # Prompt (4) + 2 placeholders reach max_model_len: the third schedule is empty.
    assert [dict(s.num_scheduled_tokens) for s, _ in steps] == [{"r": 4}, {"r": 1}, {}]
    outputs = []
    for step, samplers in steps[:2]:
        outputs += scheduler.update_from_output(step, sampled_output(step, samplers))
    assert outputs[-1].finish_reason == "length" and request.num_tokens == 6


def test_stop_at_step_t_discards_step_t_plus_1_and_frees_once(make_scheduler, make_request):
    scheduler = make_scheduler(async_scheduling=True, num_blocks=16)
    free_before = scheduler.kv_cache_manager.num_free_blocks
    request = make_request("r", [10, 11, 12], eos_token_id=EOS, max_tokens=10)
    other = make_request("o", [20, 21, 22, 23, 24], max_tokens=10)
    scheduler.add_request(request)
    scheduler.add_request(other)
    step0, samplers0 = schedule_noting_samplers(scheduler)
    step1, samplers1 = schedule_noting_samplers(scheduler)
    assert set(step1.num_scheduled_tokens) == {"r", "o"}
    outputs = scheduler.update_from_output(step0, sampled_output(step0, samplers0, tokens={"r": EOS}))
    finished = [o for o in outputs if o.finished]
    assert [(o.request_id, o.finish_reason) for o in finished] == [("r", "stop")]
    assert request.output_token_ids == [EOS] and "r" not in scheduler.requests
    free_after_stop = scheduler.kv_cache_manager.num_free_blocks
    # The speculative step t+1 comes back with a token for "r": dropped, nothing freed twice.
    outputs = scheduler.update_from_output(step1, sampled_output(step1, samplers1, token_id=9))
    assert [o.request_id for o in outputs] == ["o"]
    assert request.output_token_ids == [EOS]
    assert scheduler.kv_cache_manager.num_free_blocks == free_after_stop
    # The worker learns about the finish with the next step.
    assert "r" in scheduler.schedule().finished_request_ids
    scheduler.finish_requests(["o"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.num_free_blocks == free_before


def test_abort_with_two_steps_in_flight(make_scheduler, make_request):
    scheduler = make_scheduler(async_scheduling=True, num_blocks=16)
    free_before = scheduler.kv_cache_manager.num_free_blocks
    scheduler.add_request(make_request("a", [10, 11, 12, 13], max_tokens=10))
    scheduler.add_request(make_request("b", [14, 15], max_tokens=10))
    step0, samplers0 = schedule_noting_samplers(scheduler)
    step1, samplers1 = schedule_noting_samplers(scheduler)
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.num_free_blocks < free_before  # "b" still holds blocks
    outputs = scheduler.update_from_output(step0, sampled_output(step0, samplers0))
    outputs += scheduler.update_from_output(step1, sampled_output(step1, samplers1))
    assert {o.request_id for o in outputs} == {"b"}
    scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.num_free_blocks == free_before
    assert not scheduler.has_unfinished_requests()


def test_preempted_while_in_flight_keeps_its_token(make_scheduler, make_request):
    # 4 usable blocks of 4 tokens: two requests of 7 tokens fill them; the next decode preempts one.
    scheduler = make_scheduler(async_scheduling=True, num_blocks=5, block_size=4, max_num_batched_tokens=64)
    first = make_request("a", list(range(10, 17)), max_tokens=10)
    second = make_request("b", list(range(20, 27)), max_tokens=10)
    scheduler.add_request(first)
    scheduler.add_request(second)
    step0, samplers0 = schedule_noting_samplers(scheduler)  # both prompts; each samples
    step1, samplers1 = schedule_noting_samplers(scheduler)  # decodes at position 7: still in block 2
    step2, samplers2 = schedule_noting_samplers(scheduler)  # position 8 needs a 3rd block: "b" preempted
    assert step2.preempted_request_ids == {"b"} and second.status == RequestStatus.PREEMPTED
    assert second.num_output_placeholders == 2  # steps 0 and 1 sampled for it, still in flight
    # Not admitted again while its tokens are in flight (depth 3 here: a pipeline's queue).
    step3, _ = schedule_noting_samplers(scheduler)
    assert "b" not in step3.num_scheduled_tokens
    scheduler.update_from_output(step0, sampled_output(step0, samplers0, token_id=50))
    scheduler.update_from_output(step1, sampled_output(step1, samplers1, token_id=51))
    # The preempted request took both tokens: they are recomputed with its prompt.
    assert second.output_token_ids == [50, 51] and second.num_output_placeholders == 0
    scheduler.update_from_output(step2, sampled_output(step2, samplers2, token_id=52))
    scheduler.update_from_output(step3, sampled_output(step3, set()))
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    resumed = scheduler.schedule()
    assert resumed.scheduled_new_requests[0].request_id == "b"
    assert resumed.scheduled_new_requests[0].token_ids == list(range(20, 27)) + [50, 51]


def test_preempted_request_can_stop_on_its_in_flight_token(make_scheduler, make_request):
    scheduler = make_scheduler(async_scheduling=True, num_blocks=5, block_size=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", list(range(10, 17)), max_tokens=10))
    scheduler.add_request(make_request("b", list(range(20, 27)), max_tokens=10, eos_token_id=EOS))
    step0, samplers0 = schedule_noting_samplers(scheduler)
    step1, _ = schedule_noting_samplers(scheduler)
    step2, _ = schedule_noting_samplers(scheduler)
    assert step2.preempted_request_ids == {"b"}
    outputs = scheduler.update_from_output(step0, sampled_output(step0, samplers0, tokens={"b": EOS}))
    assert [(o.request_id, o.finish_reason) for o in outputs if o.finished] == [("b", "stop")]
    assert len(scheduler.waiting) == 0 and "b" not in scheduler.requests
