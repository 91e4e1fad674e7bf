"""Request: the scheduler's view of one sequence being generated.

Invariant: `num_computed_tokens <= num_tokens + num_output_placeholders`. Each step the scheduler lets
computed tokens catch up with known tokens (prompt + generated); that one rule covers prefill, chunked
prefill, decode, prefix cache hits (they advance num_computed_tokens) and recompute after preemption.

With async scheduling a step can be scheduled before the previous step's sampled token is back: that
token is a *placeholder* (counted, its id unknown to the scheduler). The worker, which runs steps in
order, already holds its id when the next step runs, so the position can be computed anyway.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Holding its blocks while a KV connector loads their KV from another engine (kv_transfer/).
    WAITING_FOR_REMOTE_KVS = 3
    # Everything from here on is finished.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower value = served first (vLLM convention)
    # Extra keys mixed into block hashes (e.g. a cache salt); requests with different keys never share KV.
    cache_salt: str | None = None

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens sampled by scheduled steps whose ids have not come back yet (0 between synchronous steps).
    num_output_placeholders: int = 0
    # Prompt tokens served from the prefix cache at first admission (for metrics and RequestOutput).
    num_cached_tokens: int = -1
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Hashes of this request's full blocks, filled lazily by the KV cache manager.
    block_hashes: list[int] = field(default_factory=list)
    # Speculative decoding: draft tokens proposed for the positions after the known ones, to be verified by the
    # next step that schedules this request (not part of num_tokens; dropped on preemption).
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        assert self.sampling_params.max_tokens is not None, "the input processor fills max_tokens"
        return self.sampling_params.max_tokens

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def token_id_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)

    def get_finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def __lt__(self, other: "Request") -> bool:
        # Priority queue order: priority, then arrival.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority, other.arrival_time, other.request_id)
