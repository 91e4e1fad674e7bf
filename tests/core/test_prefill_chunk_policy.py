"""The scheduler's prefill-chunk seam: the policy caps chunks, sees the step's other tokens and history."""
from __future__ import annotations

from pagedserve.config.scheduler import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.prefill_chunk_policy import PrefillChunkPolicy
from pagedserve.core.profiling_chunk_predictor import LatencyModel, ProfilingChunkPolicy
from pagedserve.core.scheduler import Scheduler


class RecordingPolicy(PrefillChunkPolicy):
    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.calls: list[tuple[int, int]] = []

    def prefill_token_cap(self, num_other_tokens: int, num_history_tokens: int) -> int | None:
        self.calls.append((num_other_tokens, num_history_tokens))
        return self.cap


def _scheduler(policy: PrefillChunkPolicy | None, enable_chunked_prefill: bool = True) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=64,
                             enable_chunked_prefill=enable_chunked_prefill)
    return Scheduler(config, KVCacheManager(64, 4, False), 4, prefill_chunk_policy=policy)


def test_policy_caps_prefill_chunks_and_sees_decodes(make_request, model_output) -> None:
    policy = RecordingPolicy(cap=8)
    scheduler = _scheduler(policy)
    scheduler.add_request(make_request("a", list(range(3))))
    scheduler.add_request(make_request("b", list(range(20))))
    first = scheduler.schedule()
    # Both prompts are prefills: "a" (3 tokens, under the cap) first, then "b" sees a's 3 tokens.
    assert first.num_scheduled_tokens == {"a": 3, "b": 8}
    assert policy.calls == [(0, 0), (3, 0)]
    scheduler.update_from_output(first, model_output(scheduler, first))
    policy.calls.clear()
    second = scheduler.schedule()
    # "a" now decodes (1 token, not asked about); "b" continues from 8 computed tokens beside 1 decode.
    assert second.num_scheduled_tokens == {"a": 1, "b": 8}
    assert policy.calls == [(1, 8)]


def test_no_policy_and_chunking_off_keep_todays_behaviour(make_request) -> None:
    uncapped = _scheduler(None)
    uncapped.add_request(make_request("b", list(range(20))))
    assert uncapped.schedule().num_scheduled_tokens == {"b": 20}
    policy = RecordingPolicy(cap=8)
    whole = _scheduler(policy, enable_chunked_prefill=False)
    whole.add_request(make_request("b", list(range(20))))
    assert whole.schedule().num_scheduled_tokens == {"b": 20}  # a whole prompt is never cut
    assert policy.calls == []


def test_profiling_policy_in_the_scheduler(make_request, model_output) -> None:
    # 1 ms per token, 20 ms budget: with 4 running decodes a chunk gets 16 tokens (aligned to 4).
    policy = ProfilingChunkPolicy(LatencyModel(0.0, 1e-3, 0.0), step_budget_seconds=0.02, block_size=4,
                                  max_chunk=64, min_chunk=4)
    scheduler = _scheduler(policy)
    for index in range(4):
        scheduler.add_request(make_request(f"d{index}", [index + 1]))
    first = scheduler.schedule()
    scheduler.update_from_output(first, model_output(scheduler, first))
    scheduler.add_request(make_request("long", list(range(40))))
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "long": 16}
