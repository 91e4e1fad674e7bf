"""InputBatch: persistent per-request state on the worker side (the "persistent batch").

Each live request owns one row of preallocated host arrays (token ids, block table, counters) from its
first schedule until it finishes or is preempted; each step only applies the scheduler's deltas (new
blocks, new computed-token counts, the token sampled last step), so building the next step's inputs is
a handful of vectorised gathers instead of per-request list rebuilding.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.core.scheduler_output import NewRequestData
from pagedserve.sampling_params import SamplingParams


@dataclass
class RequestState:
    request_id: str
    row: int
    num_prompt_tokens: int
    sampling_params: SamplingParams


class InputBatch:
    def __init__(self, max_num_requests: int, max_model_len: int, block_size: int) -> None:
        self.max_num_requests = max_num_requests
        self.max_model_len = max_model_len
        self.block_size = block_size
        max_blocks_per_request = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_requests, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_requests, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_requests, dtype=np.int64)
        self.block_table = np.zeros((max_num_requests, max_blocks_per_request), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_requests, dtype=np.int64)
        self.requests: dict[str, RequestState] = {}
        self._free_rows = list(range(max_num_requests - 1, -1, -1))
        # Live requests that asked for prompt logprobs: while 0 the runner skips looking for them.
        self.num_prompt_logprobs_requests = 0
        # Bumped whenever a request joins or leaves: per-step caches keyed on the batch's requests
        # (the runner's sampling metadata) are valid only while it is unchanged.
        self.version = 0

    def add_request(self, new: NewRequestData) -> RequestState:
        if not self._free_rows:
            raise RuntimeError(f"more than max_num_seqs={self.max_num_requests} live requests on the worker")
        row = self._free_rows.pop()
        num_tokens = len(new.token_ids)
        self.token_ids[row, :num_tokens] = new.token_ids
        self.num_tokens[row] = num_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, new.block_ids)
        state = RequestState(new.request_id, row, new.num_prompt_tokens, new.sampling_params)
        self.requests[new.request_id] = state
        self.version += 1
        if new.sampling_params.prompt_logprobs is not None:
            self.num_prompt_logprobs_requests += 1
        return state

    def remove_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            self._free_rows.append(state.row)
            self.version += 1
            if state.sampling_params.prompt_logprobs is not None:
                self.num_prompt_logprobs_requests -= 1

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            start = int(self.num_blocks[row])
            self.block_table[row, start:start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append token_ids[i] to row rows[i] (distinct rows: the tokens one step sampled) in one vectorised write."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def extend_tokens(self, row: int, start: int, token_ids: list[int]) -> None:
        """Make `token_ids` the tokens from position `start` on, appending those the row lacks (tokens
        it already holds are the same ones: pipeline stages learn sampled tokens this way)."""
        num_tokens = int(self.num_tokens[row])
        num_new = start + len(token_ids) - num_tokens
        if num_new > 0:
            self.token_ids[row, num_tokens:num_tokens + num_new] = token_ids[len(token_ids) - num_new:]
            self.num_tokens[row] = num_tokens + num_new

    def prompt_token_ids(self, state: RequestState) -> list[int]:
        return self.token_ids[state.row, :state.num_prompt_tokens].tolist()

    def output_token_ids(self, state: RequestState) -> list[int]:
        return self.token_ids[state.row, state.num_prompt_tokens:self.num_tokens[state.row]].tolist()


@dataclass
class StepInputs:
    """Flat model inputs for one step plus the per-request bookkeeping to read the outputs back."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    positions_cpu: np.ndarray  # the same positions on the host (slot mapping needs them; no device sync)
    request_ids: list[str]  # in batch order
    rows: np.ndarray  # [num_requests] the requests' rows in the InputBatch
    # [num_tokens] the request (index into request_ids) of each token; None when every request
    # computes exactly one token (token t belongs to request t).
    token_requests: np.ndarray | None
    num_scheduled: np.ndarray  # [num_requests]
    query_start_loc: np.ndarray  # [num_requests + 1]
    num_computed_before: np.ndarray  # [num_requests]
    # Requests that reach the end of their known tokens this step sample one token.
    is_sampled: np.ndarray  # [num_requests] bool


def as_decode_rows(step: StepInputs) -> StepInputs:
    """The same tokens as one-token rows (row t: its request's row of the batch, seq_len position + 1), for the
    attention metadata of a multi-token step that decode kernels can run: causal attention over a request's new
    tokens equals each token attending the cache up to its own position, because a layer writes every token's K/V
    before any token attends (every backend, and the native decode stack, do)."""
    if step.token_requests is None:
        return step
    num_tokens = len(step.positions_cpu)
    return StepInputs(input_ids=step.input_ids, positions=step.positions, positions_cpu=step.positions_cpu,
                      request_ids=step.request_ids, rows=step.rows[step.token_requests], token_requests=None,
                      num_scheduled=np.ones(num_tokens, dtype=np.int64),
                      query_start_loc=np.arange(num_tokens + 1, dtype=np.int64),
                      num_computed_before=step.positions_cpu, is_sampled=step.is_sampled)


def step_over_positions(batch: "InputBatch", request_ids: list[str], rows: np.ndarray, starts: np.ndarray,
                        num_scheduled: np.ndarray, device: torch.device, token_offset: int = 0) -> StepInputs:
    """A forward over positions [starts[i], starts[i] + num_scheduled[i]) of each row (a drafter's): the input id
    at position p is the row's token at p + token_offset (hidden-state drafters read the next token: 1)."""
    query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(num_scheduled, out=query_start_loc[1:])
    if bool((num_scheduled == 1).all()):
        token_requests = None
        positions = starts.astype(np.int64, copy=True)
        input_ids = batch.token_ids[rows, positions + token_offset]
    else:
        token_requests = np.repeat(np.arange(len(rows)), num_scheduled)
        positions = starts[token_requests] + (np.arange(int(query_start_loc[-1])) - query_start_loc[token_requests])
        input_ids = batch.token_ids[rows[token_requests], positions + token_offset]
    return StepInputs(input_ids=torch.from_numpy(input_ids).to(device),
                      positions=torch.from_numpy(positions).to(device), positions_cpu=positions,
                      request_ids=request_ids, rows=rows, token_requests=token_requests,
                      num_scheduled=num_scheduled, query_start_loc=query_start_loc,
                      num_computed_before=starts, is_sampled=np.ones(len(rows), dtype=bool))
