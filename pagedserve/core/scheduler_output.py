"""What the scheduler hands the model runner each step, and what comes back.

The worker side is stateful (a persistent batch): a request arrives whole once (NewRequestData), and
afterwards only as a delta (CachedRequestData). These are plain data with no torch objects, so they
can cross process boundaries (msgspec/msgpack) unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.core.sparse_kv_offload_stats import SparseKVOffloadStats
from pagedserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request scheduled for the first time, or again after preemption (then with all its tokens)."""

    request_id: str
    # All known tokens: the prompt plus any outputs generated before a preemption.
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """Deltas for requests the worker already holds: new blocks and the new computed-token count.

    The worker that samples appends the token itself, so no token ids travel here — except with
    pipeline parallelism, where only the last stage samples: then `new_token_ids[i]` holds the
    generated tokens among the positions this step computes for request i (those from position
    max(num_computed_tokens[i], num_prompt_tokens) on), and the other stages append the ones they lack.
    Empty when not needed.
    """

    request_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)


@dataclass
class GrammarBitmask:
    """Structured outputs: the allowed tokens of the rows a step samples for constrained requests.

    `bitmask` holds int32 words [num_rows, num_words] (native byte order; bit j of word w set: token 32*w + j
    allowed). A constrained request owns rows first_row[id] .. first_row[id] + its drafts this step (one per
    sampled position); rows of other requests are not constrained.
    """

    first_row: dict[str, int]
    num_rows: int
    num_words: int
    bitmask: bytes


@dataclass
class SchedulerOutput:
    scheduled_new_requests: list[NewRequestData]
    scheduled_cached_requests: CachedRequestData
    # request id -> number of tokens computed for it this step.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that finished or were preempted since the last step: the worker drops their state.
    finished_request_ids: set[str] = field(default_factory=set)
    preempted_request_ids: set[str] = field(default_factory=set)
    # Speculative decoding: request id -> the draft tokens this step verifies (they follow the request's known
    # tokens and are counted in its num_scheduled_tokens). Only requests with drafts appear.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # The KV connector's orders for this step's worker side (kv_transfer/; built by its scheduler side); None
    # without a connector.
    kv_connector_metadata: Any = None
    # Structured outputs: the token bitmask of the constrained rows this step samples (None: no such row).
    grammar_bitmask: GrammarBitmask | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class LogprobsLists:
    """Top-N logprobs for sampled positions, one row per sampled token of a request.

    logprob_token_ids[i][0] is the sampled token; the next entries are the top-N by rank.
    """

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]

    def slice(self, row: int, num_logprobs: int) -> "LogprobsLists":
        """Row `row` alone, cut to the scored token plus its top num_logprobs (pure Python, no copy to host)."""
        if not 0 <= row < len(self.sampled_token_ranks):
            raise ValueError(f"row={row} must be in [0, {len(self.sampled_token_ranks) - 1}]")
        max_num_logprobs = len(self.logprob_token_ids[row]) - 1
        if not 0 <= num_logprobs <= max_num_logprobs:
            raise ValueError(f"num_logprobs={num_logprobs} must be in [0, {max_num_logprobs}]")
        return LogprobsLists(
            logprob_token_ids=[self.logprob_token_ids[row][:num_logprobs + 1]],
            logprobs=[self.logprobs[row][:num_logprobs + 1]],
            sampled_token_ranks=[self.sampled_token_ranks[row]],
        )


@dataclass
class KVConnectorOutput:
    """What the KV connector's worker side reports each step (kv_transfer/connector_base.py)."""

    # Requests whose blocks no remote engine needs any more (read, or timed out): free them now.
    finished_sending: set[str] = field(default_factory=set)
    # Requests whose remote KV load ended (loaded, failed or cancelled): they may run (or be freed).
    finished_recving: set[str] = field(default_factory=set)
    # Blocks of finished_recving requests whose KV did not arrive.
    invalid_block_ids: set[int] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


@dataclass
class ModelRunnerOutput:
    request_ids: list[str]
    # Per request in request_ids: tokens sampled this step ([] for a partial prefill chunk; with speculative
    # decoding the accepted drafts followed by one token of the target's own).
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # request id -> logprobs for the prompt positions computed this step (position i predicts token i+1).
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # EPLB: (imbalance before, after) per MoE layer when this step ended with a rebalance, else None.
    eplb_imbalance: list[tuple[float, float]] | None = None
    # Speculative decoding: per request in request_ids, the drafts proposed for its next step ([]: none);
    # empty when speculation is off.
    spec_token_ids: list[list[int]] = field(default_factory=list)
    # Sparse KV offload: the worker's counters after this step; None when offload is off.
    sparse_kv_offload_stats: SparseKVOffloadStats | None = None
    # The KV connector's report for this step (None without a connector).
    kv_connector_output: KVConnectorOutput | None = None

EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(request_ids=[], sampled_token_ids=[])
