"""Scheduling drafts (speculative decoding) with exact counts: drafts follow the known tokens, rejected ones
roll num_computed_tokens back, limits trim them, preemption drops them, and the counters add up."""
from __future__ import annotations

from pagedserve.core.scheduler_output import ModelRunnerOutput


def _run(scheduler, sampled: dict[str, list[int]], drafts: dict[str, list[int]]):
    """Schedule one step, then report `sampled` tokens and next-step `drafts` per request."""
    scheduler_output = scheduler.schedule()
    request_ids = list(scheduler_output.num_scheduled_tokens)
    output = ModelRunnerOutput(request_ids=request_ids,
                               sampled_token_ids=[sampled.get(rid, []) for rid in request_ids],
                               spec_token_ids=[drafts.get(rid, []) for rid in request_ids])
    return scheduler_output, scheduler.update_from_output(scheduler_output, output)


def test_drafts_are_scheduled_after_the_known_tokens_and_rejections_roll_back(make_scheduler, make_request):
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    scheduler.add_request(make_request("a", list(range(10)), max_tokens=30))
    first, _ = _run(scheduler, {"a": [50]}, {"a": [51, 52, 53]})  # prefill samples 50, drafts 51..53
    assert first.num_scheduled_tokens == {"a": 10} and first.scheduled_spec_decode_tokens == {}
    request = scheduler.requests["a"]
    assert request.spec_token_ids == [51, 52, 53] and request.num_computed_tokens == 10

    # Verification: the last known token (50) and three drafts; two drafts accepted plus one token of its own.
    second, outputs = _run(scheduler, {"a": [51, 52, 60]}, {"a": [61]})
    assert second.num_scheduled_tokens == {"a": 4}
    assert second.scheduled_spec_decode_tokens == {"a": [51, 52, 53]}
    assert outputs[0].new_token_ids == [51, 52, 60]
    # Positions 10 (token 50), 11 (51), 12 (52) are verified; 13 held the rejected draft 53.
    assert request.num_computed_tokens == 13 and request.num_tokens == 14
    assert request.num_output_placeholders == 0 and request.spec_token_ids == [61]
    stats = scheduler.make_stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens, stats.spec_decode_num_accepted_tokens_per_pos) == (1, 3, 2, [1, 1, 0])

    third, _ = _run(scheduler, {"a": [61, 62]}, {})  # all accepted: the bonus token too
    assert third.num_scheduled_tokens == {"a": 2} and third.scheduled_spec_decode_tokens == {"a": [61]}
    assert request.num_computed_tokens == 15 and request.num_tokens == 16 and request.spec_token_ids == []
    assert scheduler.make_stats().spec_decode_num_accepted_tokens_per_pos == [2, 1, 0]


def test_drafts_are_trimmed_by_budget_max_tokens_and_max_model_len(make_scheduler, make_request):
    scheduler = make_scheduler(num_blocks=32, block_size=4, max_model_len=16, max_num_batched_tokens=3)
    scheduler.add_request(make_request("a", list(range(3)), max_tokens=5))
    _run(scheduler, {"a": [50]}, {"a": [1, 2, 3, 4, 5, 6]})
    # max_tokens=5 with one output: a step emits at most drafts + 1, so 3 drafts are kept.
    assert scheduler.requests["a"].spec_token_ids == [1, 2, 3]
    second, _ = _run(scheduler, {"a": [1]}, {"a": [7, 8, 9]})
    # The token budget (3) leaves room for the last known token and two drafts.
    assert second.scheduled_spec_decode_tokens == {"a": [1, 2]}
    assert scheduler.requests["a"].num_computed_tokens == 4
    assert scheduler.requests["a"].spec_token_ids == [7, 8]  # max_tokens: 2 outputs, room for 2 drafts + 1

    long = make_scheduler(num_blocks=32, block_size=4, max_model_len=12)
    long.add_request(make_request("b", list(range(9)), max_tokens=100))
    _run(long, {"b": [50]}, {"b": [1, 2, 3, 4]})
    # 10 tokens of max_model_len 12: one draft plus one token of the step's own.
    assert long.requests["b"].spec_token_ids == [1]


def test_preemption_drops_drafts_and_a_stop_ends_the_request(make_scheduler, make_request):
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    scheduler.add_request(make_request("a", list(range(6)), max_tokens=30, stop_token_ids=[99]))
    _run(scheduler, {"a": [50]}, {"a": [51, 99, 53]})
    request = scheduler.requests["a"]
    scheduler._preempt(scheduler.running.pop())
    assert request.spec_token_ids == [] and request.num_computed_tokens == 0
    scheduler.requests.pop("a")
    # A stop token inside the accepted drafts ends the request there; the tokens after it are dropped.
    other = make_scheduler(num_blocks=32, block_size=4)
    other.add_request(make_request("b", list(range(6)), max_tokens=30, stop_token_ids=[99]))
    _run(other, {"b": [50]}, {"b": [51, 99, 53]})
    _, outputs = _run(other, {"b": [51, 99, 53, 54]}, {"b": [1]})
    assert outputs[0].new_token_ids == [51, 99] and outputs[0].finish_reason == "stop"
    assert "b" not in other.requests and other.kv_cache_manager.num_free_blocks == 32 - 1
