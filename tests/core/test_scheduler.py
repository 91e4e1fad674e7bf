"""Scheduler decisions with exact token counts, block ids and preemption order (no model)."""
from __future__ import annotations

import pytest

from pagedserve.core.request import RequestStatus
from pagedserve.core.scheduler_output import LogprobsLists, ModelRunnerOutput


def step(scheduler, model_output, next_token=lambda request_id: 7):
    """One engine step: schedule, fabricate the model output, update. Returns (schedule, outputs)."""
    scheduler_output = scheduler.schedule()
    outputs = scheduler.update_from_output(scheduler_output, model_output(scheduler, scheduler_output, next_token))
    return scheduler_output, outputs


def cached_view(scheduler_output) -> dict[str, tuple[list[int], int]]:
    cached = scheduler_output.scheduled_cached_requests
    return {request_id: (block_ids, num_computed) for request_id, block_ids, num_computed
            in zip(cached.request_ids, cached.new_block_ids, cached.num_computed_tokens)}


def num_free_blocks(scheduler) -> int:
    return scheduler.kv_cache_manager.num_free_blocks


# ---------------------------------------------------------------- budgets and chunking


def test_chunked_prefill_splits_a_long_prompt_and_sends_block_deltas(make_scheduler, make_request, model_output):
    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", list(range(20))))

    first, outputs = step(scheduler, model_output)
    assert first.num_scheduled_tokens == {"a": 8} and first.total_num_scheduled_tokens == 8
    (new,) = first.scheduled_new_requests
    assert (new.request_id, new.token_ids, new.num_prompt_tokens, new.block_ids, new.num_computed_tokens) == (
        "a", list(range(20)), 20, [1, 2], 0)
    assert outputs == []  # a partial chunk samples nothing

    second, outputs = step(scheduler, model_output)
    assert second.scheduled_new_requests == []
    assert second.num_scheduled_tokens == {"a": 8}
    assert cached_view(second) == {"a": ([3, 4], 8)}
    assert outputs == []

    third, outputs = step(scheduler, model_output)
    assert third.num_scheduled_tokens == {"a": 4}
    assert cached_view(third) == {"a": ([5], 16)}
    assert [(out.request_id, out.new_token_ids, out.finished) for out in outputs] == [("a", [7], False)]

    fourth, _ = step(scheduler, model_output)  # decode: position 20 opens block 6
    assert fourth.num_scheduled_tokens == {"a": 1}
    assert cached_view(fourth) == {"a": ([6], 20)}
    fifth, _ = step(scheduler, model_output)
    assert cached_view(fifth) == {"a": ([], 21)}


def test_mixed_prefill_and_decode_in_one_step(make_scheduler, make_request, model_output):
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", list(range(3))))
    step(scheduler, model_output)
    scheduler.add_request(make_request("b", list(range(100, 110))))
    mixed, _ = step(scheduler, model_output)
    assert mixed.num_scheduled_tokens == {"a": 1, "b": 7}  # the decode first, then a prefill chunk
    assert cached_view(mixed) == {"a": ([], 3)}
    assert [new.request_id for new in mixed.scheduled_new_requests] == ["b"]
    after, _ = step(scheduler, model_output)
    assert after.num_scheduled_tokens == {"a": 1, "b": 3}


def test_max_num_seqs_limits_running_requests(make_scheduler, make_request, model_output):
    scheduler = make_scheduler(max_num_seqs=2)
    for request_id in "abc":
        scheduler.add_request(make_request(request_id, [1, 2, 3], max_tokens=2))
    first, _ = step(scheduler, model_output)
    assert list(first.num_scheduled_tokens) == ["a", "b"]
    second, outputs = step(scheduler, model_output)
    assert list(second.num_scheduled_tokens) == ["a", "b"]
    assert all(out.finish_reason == "length" for out in outputs)
    third, _ = step(scheduler, model_output)
    assert third.num_scheduled_tokens == {"c": 3}
    assert third.finished_request_ids == {"a", "b"}


@pytest.mark.parametrize(("enable_chunked_prefill", "expected_first_step"),
                         [(False, {"a": 10}), (True, {"a": 10, "b": 6})])
def test_chunking_off_keeps_prompts_whole(make_scheduler, make_request, model_output,
                                          enable_chunked_prefill, expected_first_step):
    scheduler = make_scheduler(max_num_batched_tokens=16, max_model_len=16,
                               enable_chunked_prefill=enable_chunked_prefill)
    scheduler.add_request(make_request("a", list(range(10))))
    scheduler.add_request(make_request("b", list(range(50, 60))))
    first, _ = step(scheduler, model_output)
    assert first.num_scheduled_tokens == expected_first_step
    second, _ = step(scheduler, model_output)
    expected_second_step = {"a": 1, "b": 10} if not enable_chunked_prefill else {"a": 1, "b": 4}
    assert second.num_scheduled_tokens == expected_second_step


def test_long_prefill_token_threshold_caps_each_chunk(make_scheduler, make_request, model_output):
    scheduler = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=5)
    scheduler.add_request(make_request("a", list(range(12))))
    scheduler.add_request(make_request("b", list(range(50, 53))))
    first, _ = step(scheduler, model_output)
    assert first.num_scheduled_tokens == {"a": 5, "b": 3}
    second, _ = step(scheduler, model_output)
    assert second.num_scheduled_tokens == {"a": 5, "b": 1}
    third, _ = step(scheduler, model_output)
    assert third.num_scheduled_tokens == {"a": 2, "b": 1}


def test_empty_or_too_long_prompt_and_duplicate_ids_are_rejected(make_scheduler, make_request):
    scheduler = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match=r"prompt length=0 .* must be in \[1, max_model_len=8\]"):
        scheduler.add_request(make_request("a", []))
    with pytest.raises(ValueError, match="prompt length=9"):
        scheduler.add_request(make_request("a", list(range(9))))
    scheduler.add_request(make_request("a", list(range(8))))
    with pytest.raises(ValueError, match="request_id='a'"):
        scheduler.add_request(make_request("a", [1]))
    assert scheduler.schedule().num_scheduled_tokens == {"a": 8}


# ---------------------------------------------------------------- prefix caching


def test_prefix_hit_skips_cached_tokens(make_scheduler, make_request, model_output):
    scheduler = make_scheduler(num_blocks=16)
    scheduler.add_request(make_request("a", list(range(10)), max_tokens=1))
    step(scheduler, model_output)  # a: blocks 1-3, finishes at once, blocks freed
    scheduler.add_request(make_request("b", list(range(9)) + [99]))
    scheduler_output, outputs = step(scheduler, model_output)
    (new,) = scheduler_output.scheduled_new_requests
    assert new.num_computed_tokens == 8 and new.block_ids == [1, 2, 4]
    assert scheduler_output.num_scheduled_tokens == {"b": 2}
    assert outputs[0].num_cached_tokens == 8
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)


def test_identical_prompts_admitted_in_one_step_share_blocks(make_scheduler, make_request, model_output):
    scheduler = make_scheduler(num_blocks=16)
    scheduler.add_request(make_request("a", list(range(9))))
    scheduler.add_request(make_request("b", list(range(9))))
    scheduler_output, _ = step(scheduler, model_output)
    # b hits a's two full blocks, registered when a's slots were allocated earlier in this step.
    assert scheduler_output.num_scheduled_tokens == {"a": 9, "b": 1}
    assert [new.block_ids for new in scheduler_output.scheduled_new_requests] == [[1, 2, 3], [1, 2, 4]]


# ---------------------------------------------------------------- preemption


def start_three_requests(make_scheduler, make_request, model_output):
    """Three 7-token requests on 6 usable blocks of 4: after two steps each needs a third block."""
    scheduler = make_scheduler(num_blocks=7)
    for index, request_id in enumerate("abc"):
        scheduler.add_request(make_request(request_id, list(range(10 * index, 10 * index + 7)), max_tokens=10))
    first, _ = step(scheduler, model_output)
    assert [new.block_ids for new in first.scheduled_new_requests] == [[1, 2], [3, 4], [5, 6]]
    second, _ = step(scheduler, model_output)
    assert second.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1} and num_free_blocks(scheduler) == 0
    return scheduler


def test_fcfs_preempts_the_newest_running_request(make_scheduler, make_request, model_output):
    scheduler = start_three_requests(make_scheduler, make_request, model_output)
    third, _ = step(scheduler, model_output)
    # a cannot grow: c (newest) is preempted; its blocks come back tail first (6, 5).
    assert third.preempted_request_ids == {"c"}
    assert third.num_scheduled_tokens == {"a": 1, "b": 1}
    assert cached_view(third) == {"a": ([6], 8), "b": ([5], 8)}
    c = scheduler.requests["c"]
    assert (c.status, c.num_computed_tokens, c.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert c.output_token_ids == [7, 7]
    assert scheduler.make_stats().num_preemptions == 1
    assert [request.request_id for request in scheduler.waiting] == ["c"]

    # a and b fit in their third blocks; c waits for free blocks.
    fourth, _ = step(scheduler, model_output)
    assert fourth.num_scheduled_tokens == {"a": 1, "b": 1}
    assert fourth.preempted_request_ids == set()


def test_resumed_request_is_sent_whole_again(make_scheduler, make_request, model_output):
    scheduler = make_scheduler(num_blocks=7, max_num_batched_tokens=64)
    for index, request_id in enumerate("abc"):
        scheduler.add_request(make_request(request_id, list(range(10 * index, 10 * index + 7)), max_tokens=3))
    step(scheduler, model_output)
    step(scheduler, model_output)
    third, outputs = step(scheduler, model_output)  # c preempted; a and b reach max_tokens
    assert third.preempted_request_ids == {"c"}
    assert {out.request_id: out.finish_reason for out in outputs} == {"a": "length", "b": "length"}
    fourth, _ = step(scheduler, model_output)
    (resumed,) = fourth.scheduled_new_requests
    # All known tokens (prompt + 2 outputs), recomputed from scratch: c's old blocks 5 and 6 were
    # reused by a and b, which lost their hashes. a's blocks came back as 6, 2, 1; b's as 5, 4, 3.
    assert resumed.request_id == "c" and resumed.token_ids == list(range(20, 27)) + [7, 7]
    assert resumed.num_prompt_tokens == 7
    assert resumed.num_computed_tokens == 0
    assert resumed.block_ids == [6, 2, 1]
    assert fourth.num_scheduled_tokens == {"c": 9}
    assert fourth.finished_request_ids == {"a", "b"}


def test_resumed_request_hits_its_own_surviving_blocks(make_scheduler, make_request, model_output):
    scheduler = make_scheduler(num_blocks=8)
    for index, request_id in enumerate("abc"):
        scheduler.add_request(make_request(request_id, list(range(10 * index, 10 * index + 7))))
    step(scheduler, model_output)  # a: 1, 2; b: 3, 4; c: 5, 6; free: 7
    step(scheduler, model_output)
    third, _ = step(scheduler, model_output)
    assert third.preempted_request_ids == {"c"}  # a took block 7; c's blocks return as 6, 5; b took 6
    assert cached_view(third) == {"a": ([7], 8), "b": ([6], 8)}
    scheduler.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    fourth, _ = step(scheduler, model_output)
    (resumed,) = fourth.scheduled_new_requests
    # Block 5 (c's first block) survived in the free queue; its second block was reused by b.
    assert (resumed.num_computed_tokens, resumed.block_ids) == (4, [5, 7, 2])
    assert fourth.num_scheduled_tokens == {"c": 5}
    assert scheduler.requests["c"].num_cached_tokens == 0  # the first admission's figure is kept


@pytest.mark.parametrize(("policy", "expected_preempted", "expected_view"), [
    ("fcfs", {"b"}, {"low": ([], 5), "a": ([7], 8)}),  # the newest (b, itself) goes
    ("priority", {"low"}, {"a": ([7], 8), "b": ([6], 8)}),  # the largest priority value goes
])
def test_preemption_victim_by_policy(make_scheduler, make_request, model_output,
                                     policy, expected_preempted, expected_view):
    scheduler = make_scheduler(num_blocks=8, policy=policy)
    scheduler.add_request(make_request("low", [1, 2, 3], priority=2))
    step(scheduler, model_output)  # low: block 1
    scheduler.add_request(make_request("a", list(range(10, 17)), priority=0))
    scheduler.add_request(make_request("b", list(range(20, 27)), priority=1))
    second, _ = step(scheduler, model_output)
    assert [new.block_ids for new in second.scheduled_new_requests] == [[2, 3], [4, 5]]
    third, _ = step(scheduler, model_output)
    assert cached_view(third) == {"low": ([6], 4), "a": ([], 7), "b": ([], 7)}
    assert [request.request_id for request in scheduler.running] == ["low", "a", "b"]
    # Block 7 is the last free one: a takes it, then b cannot grow.
    fourth, _ = step(scheduler, model_output)
    assert fourth.preempted_request_ids == expected_preempted
    assert cached_view(fourth) == expected_view
    assert fourth.total_num_scheduled_tokens == 2
    assert scheduler.num_preemptions == 1


def test_priority_preemption_can_undo_a_request_scheduled_earlier_in_the_step(
        make_scheduler, make_request, model_output):
    scheduler = make_scheduler(num_blocks=6, policy="priority")
    scheduler.add_request(make_request("low", list(range(7)), priority=5))
    step(scheduler, model_output)  # low: blocks 1, 2
    scheduler.add_request(make_request("high", list(range(100, 108)), priority=0))
    step(scheduler, model_output)  # low decodes; high: blocks 3, 4
    third, _ = step(scheduler, model_output)
    # low takes block 5, then high cannot grow: low is the victim although already scheduled.
    assert third.preempted_request_ids == {"low"}
    assert third.num_scheduled_tokens == {"high": 1} and third.total_num_scheduled_tokens == 1
    assert cached_view(third) == {"high": ([5], 8)}
    low = scheduler.requests["low"]
    assert (low.status, low.num_computed_tokens) == (RequestStatus.PREEMPTED, 0)
    # low's fully computed blocks stay cached; nothing beyond its computed tokens was registered.
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_cached_block(low.block_hashes[0]).block_id == 1
    assert pool.get_cached_block(low.block_hashes[1]).block_id == 2


def test_blocks_of_an_undone_chunk_are_not_left_in_the_prefix_cache(make_scheduler, make_request, model_output):
    scheduler = make_scheduler(num_blocks=8, policy="priority", long_prefill_token_threshold=8)
    scheduler.add_request(make_request("low", list(range(24)), priority=5))
    step(scheduler, model_output)  # low: tokens 0-7 in blocks 1, 2
    scheduler.add_request(make_request("high", [100, 101, 102, 103], priority=0))
    step(scheduler, model_output)  # low: tokens 8-15 in blocks 3, 4; high: block 5
    third, _ = step(scheduler, model_output)
    # low got blocks 6, 7 for tokens 16-23 (both full, so registered), then was undone for high.
    assert third.preempted_request_ids == {"low"}
    assert cached_view(third) == {"high": ([7], 4)}
    # Block 6 survives in the free queue, but its KV was never written: it must not be a hit.
    hits, num_hit_tokens = scheduler.kv_cache_manager.get_computed_blocks(make_request("copy", list(range(24))))
    assert (hits.get_block_ids(), num_hit_tokens) == ([1, 2, 3, 4], 16)


def test_preempting_itself_stops_the_running_loop(make_scheduler, make_request, model_output):
    scheduler = make_scheduler(num_blocks=3)  # two usable blocks
    scheduler.add_request(make_request("a", list(range(8)), max_tokens=5))
    step(scheduler, model_output)  # blocks 1, 2: full
    third, _ = step(scheduler, model_output)
    assert third.preempted_request_ids == {"a"} and third.total_num_scheduled_tokens == 0
    assert scheduler.requests["a"].num_preemptions == 1


# ---------------------------------------------------------------- aborts


@pytest.mark.parametrize("moment", ["waiting", "mid_prefill", "decoding", "preempted"])
def test_abort_frees_blocks_at_any_time(make_scheduler, make_request, model_output, moment):
    scheduler = make_scheduler(num_blocks=7, max_num_batched_tokens=4)
    scheduler.add_request(make_request("a", list(range(10))))
    if moment != "waiting":
        step(scheduler, model_output)
        assert scheduler.requests["a"].num_computed_tokens == 4
    if moment in ("decoding", "preempted"):
        step(scheduler, model_output)
        step(scheduler, model_output)
        assert scheduler.requests["a"].output_token_ids == [7]
    if moment == "preempted":
        request = scheduler.requests["a"]
        scheduler.running.remove(request)
        scheduler._preempt(request)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert num_free_blocks(scheduler) == 6
    assert all(block.ref_cnt == 0 for block in scheduler.kv_cache_manager.block_pool.blocks)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished_request_ids == {"a"}


def test_abort_ignores_unknown_and_finished_ids_and_checks_the_status(make_scheduler, make_request, model_output):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3]))
    scheduler.add_request(make_request("b", [1, 2, 3]))
    scheduler.finish_requests(["a", "missing"], RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert scheduler.get_num_unfinished_requests() == 1
    with pytest.raises(ValueError, match="finished_status"):
        scheduler.finish_requests(["b"], RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_is_skipped(make_scheduler, make_request, model_output):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3]))
    scheduler.add_request(make_request("b", [1, 2, 3]))
    scheduler_output = scheduler.schedule()
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    runner_output = ModelRunnerOutput(request_ids=["a", "b"], sampled_token_ids=[[5], [6]])
    outputs = scheduler.update_from_output(scheduler_output, runner_output)
    assert [(out.request_id, out.new_token_ids) for out in outputs] == [("b", [6])]


# ---------------------------------------------------------------- outputs and logprobs


def test_prompt_logprobs_come_with_every_chunk(make_scheduler, make_request):
    scheduler = make_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(make_request("a", list(range(6)), prompt_logprobs=1))
    scheduler.add_request(make_request("b", list(range(6))))
    chunk = LogprobsLists([[1], [2]], [[-0.5], [-0.25]], [1, 1])
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"a": 4}
    outputs = scheduler.update_from_output(first, ModelRunnerOutput(["a"], [[]], prompt_logprobs={"a": chunk}))
    assert [(out.request_id, out.new_token_ids, out.new_prompt_logprobs) for out in outputs] == [("a", [], chunk)]
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"a": 2, "b": 2}
    sampled = LogprobsLists([[9, 1]], [[-0.1, -2.0]], [1])
    outputs = scheduler.update_from_output(second, ModelRunnerOutput(
        ["a", "b"], [[9], []], logprobs={"a": sampled}, prompt_logprobs={"a": chunk}))
    assert [(out.request_id, out.new_token_ids, out.new_logprobs) for out in outputs] == [("a", [9], sampled)]
