"""Stop conditions applied by Scheduler.update_from_output, in their order of precedence."""
from __future__ import annotations

import pytest

from pagedserve.core.request import RequestStatus
from pagedserve.core.scheduler_output import LogprobsLists, ModelRunnerOutput

EOS = 2


def feed(scheduler, request_id: str, token_ids: list[int]) -> list:
    """Run steps, sampling `token_ids` one per step, until the request finishes or they run out."""
    outputs = []
    for token_id in token_ids:
        scheduler_output = scheduler.schedule()
        assert request_id in scheduler_output.num_scheduled_tokens
        step_outputs = scheduler.update_from_output(
            scheduler_output, ModelRunnerOutput([request_id], [[token_id]]))
        outputs.extend(step_outputs)
        if step_outputs and step_outputs[-1].finished:
            break
    return outputs


def run(make_scheduler, make_request, token_ids, max_model_len=64, **request_options):
    scheduler = make_scheduler(num_blocks=32, max_model_len=max_model_len)
    request = make_request("r", [10, 11, 12], eos_token_id=EOS, **request_options)
    scheduler.add_request(request)
    outputs = feed(scheduler, "r", token_ids)
    return scheduler, request, outputs


def summary(request, outputs) -> tuple:
    last = outputs[-1]
    return request.output_token_ids, last.finish_reason, last.stop_reason, request.status


def test_eos_stops_with_no_stop_reason(make_scheduler, make_request):
    scheduler, request, outputs = run(make_scheduler, make_request, [5, 6, EOS, 8])
    assert summary(request, outputs) == ([5, 6, EOS], "stop", None, RequestStatus.FINISHED_STOPPED)
    assert [out.new_token_ids for out in outputs] == [[5], [6], [EOS]]
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == 31
    assert scheduler.running == [] and "r" not in scheduler.requests
    assert scheduler.schedule().finished_request_ids == {"r"}


def test_ignore_eos_keeps_generating(make_scheduler, make_request):
    _, request, outputs = run(make_scheduler, make_request, [EOS, EOS, EOS], ignore_eos=True, max_tokens=3)
    assert summary(request, outputs) == ([EOS, EOS, EOS], "length", None, RequestStatus.FINISHED_LENGTH_CAPPED)


def test_all_stop_token_ids_act_as_eos(make_scheduler, make_request):
    _, request, outputs = run(make_scheduler, make_request, [5, 40, 6], all_stop_token_ids={40})
    assert summary(request, outputs) == ([5, 40], "stop", None, RequestStatus.FINISHED_STOPPED)


def test_stop_token_ids_report_the_token_as_stop_reason(make_scheduler, make_request):
    _, request, outputs = run(make_scheduler, make_request, [5, 30, 6], stop_token_ids=[30, 31])
    assert summary(request, outputs) == ([5, 30], "stop", 30, RequestStatus.FINISHED_STOPPED)


def test_min_tokens_defers_eos_and_stop_tokens(make_scheduler, make_request):
    _, request, outputs = run(make_scheduler, make_request, [EOS, 30, EOS, EOS, 5],
                              min_tokens=4, stop_token_ids=[30])
    assert summary(request, outputs) == ([EOS, 30, EOS, EOS], "stop", None, RequestStatus.FINISHED_STOPPED)
    _, request, outputs = run(make_scheduler, make_request, [EOS, 30, EOS, 30], min_tokens=4, stop_token_ids=[30])
    assert summary(request, outputs) == ([EOS, 30, EOS, 30], "stop", 30, RequestStatus.FINISHED_STOPPED)


def test_max_tokens_caps_the_length(make_scheduler, make_request):
    _, request, outputs = run(make_scheduler, make_request, [5, 6, 7, 8], max_tokens=3)
    assert summary(request, outputs) == ([5, 6, 7], "length", None, RequestStatus.FINISHED_LENGTH_CAPPED)


def test_max_model_len_caps_the_length(make_scheduler, make_request):
    # 3 prompt tokens + 5 outputs reach max_model_len=8.
    _, request, outputs = run(make_scheduler, make_request, [5] * 10, max_model_len=8, max_tokens=20)
    assert summary(request, outputs) == ([5] * 5, "length", None, RequestStatus.FINISHED_LENGTH_CAPPED)


def test_stop_token_wins_over_max_tokens_and_eos_over_max_model_len(make_scheduler, make_request):
    _, request, outputs = run(make_scheduler, make_request, [5, 30], max_tokens=2, stop_token_ids=[30])
    assert summary(request, outputs) == ([5, 30], "stop", 30, RequestStatus.FINISHED_STOPPED)
    _, request, outputs = run(make_scheduler, make_request, [5, EOS], max_model_len=5)
    assert summary(request, outputs) == ([5, EOS], "stop", None, RequestStatus.FINISHED_STOPPED)


def test_tokens_after_a_stop_in_one_step_are_dropped_with_their_logprobs(make_scheduler, make_request):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [10, 11, 12], eos_token_id=EOS))
    scheduler_output = scheduler.schedule()
    logprobs = LogprobsLists([[5], [EOS], [9]], [[-0.1], [-0.2], [-0.3]], [1, 1, 1])
    (output,) = scheduler.update_from_output(
        scheduler_output, ModelRunnerOutput(["r"], [[5, EOS, 9]], logprobs={"r": logprobs}))
    assert output.new_token_ids == [5, EOS] and output.finish_reason == "stop"
    assert output.new_logprobs == LogprobsLists([[5], [EOS]], [[-0.1], [-0.2]], [1, 1])


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED])
def test_front_end_finish_removes_a_request_mid_generation(make_scheduler, make_request, status):
    scheduler, request, _ = run(make_scheduler, make_request, [5, 6])
    scheduler.finish_requests(["r"], status)
    assert request.status == status and request.get_finish_reason() == {
        RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_STOPPED: "stop"}[status]
    assert scheduler.kv_cache_manager.num_free_blocks == 31
    scheduler_output = scheduler.schedule()
    assert scheduler_output.is_empty and scheduler_output.finished_request_ids == {"r"}
