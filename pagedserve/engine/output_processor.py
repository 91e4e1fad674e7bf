"""OutputProcessor: turn EngineCoreOutputs into user-facing RequestOutputs.

Per engine request it detokenizes incrementally, applies stop strings (a request that hits one must
be finished in the scheduler: its id is returned in `request_ids_to_abort`), converts LogprobsLists to
vLLM's list[dict[int, Logprob]], accumulates prompt logprobs delivered in chunks, and fans the
children of an n > 1 request back into one RequestOutput for the parent.

Output kinds (per request), as vLLM's RequestOutputKind:
  - 'cumulative': every update carries the whole text/tokens so far;
  - 'delta': every update carries only what is new (for streaming);
  - 'final_only': one RequestOutput when the request finishes (LLM.generate).
"""
from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.core.engine_core_output import EngineCoreOutput
from pagedserve.core.request import Request
from pagedserve.core.scheduler_output import LogprobsLists
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.parallel_sampling import ParentRequest
from pagedserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from pagedserve.sampling_params import SamplingParams


class RequestOutputKind(str, enum.Enum):
    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


def logprobs_lists_to_dicts(lists: LogprobsLists, num_logprobs: int,
                            decode: Callable[[int], str | None]) -> SampleLogprobs:
    """One dict per row: the row's first token (sampled, or the actual prompt token) with its rank
    from `sampled_token_ranks`, then the top-`num_logprobs` tokens with ranks 1..N. A token that is
    both keeps one entry (its top-N rank; the two ranks agree up to ties)."""
    rows: SampleLogprobs = []
    for token_ids, logprobs, rank in zip(lists.logprob_token_ids, lists.logprobs, lists.sampled_token_ranks):
        entry: dict[int, Logprob] = {int(token_ids[0]): Logprob(float(logprobs[0]), int(rank), decode(int(token_ids[0])))}
        for top_rank, (token_id, logprob) in enumerate(zip(token_ids[1:num_logprobs + 1], logprobs[1:num_logprobs + 1]),
                                                      start=1):
            entry[int(token_id)] = Logprob(float(logprob), top_rank, decode(int(token_id)))
        rows.append(entry)
    return rows


@dataclass
class ProcessedOutputs:
    # One per user-facing (parent) request with news this step.
    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Engine request ids that hit a stop string but are still running in the scheduler: the engine
    # must finish them there with FINISHED_STOPPED.
    request_ids_to_abort: list[str] = field(default_factory=list)


class RequestState:
    """Front-end state of one engine request (a child when n > 1)."""

    def __init__(self, request: Request, prompt: str | None, parent: ParentRequest | None, index: int,
                 output_kind: RequestOutputKind, tokenizer: Any | None,
                 decode_token: Callable[[int], str | None]) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.parent = parent
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = list(request.prompt_token_ids)
        self.params = params
        self.output_kind = output_kind
        self.arrival_time = request.arrival_time
        self.detokenizer = IncrementalDetokenizer(tokenizer, self.prompt_token_ids, params)
        self.decode_token = decode_token
        self.output_token_ids: list[int] = []
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = [None] if params.prompt_logprobs is not None else None
        self.is_prompt_logprobs_sent = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        # A KV producer's handle on the request's blocks (kv_transfer/), set when it finishes.
        self.kv_transfer_params: dict[str, Any] | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        # Where the current step's new tokens start (for delta outputs).
        self.step_token_start = 0

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, output: EngineCoreOutput) -> bool:
        """Fold one EngineCoreOutput in. Returns True when a stop string hit (finishing the request)."""
        now = time.monotonic()
        self.step_token_start = len(self.output_token_ids)
        new_token_ids = list(output.new_token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.kv_transfer_params is not None:
            self.kv_transfer_params = output.kv_transfer_params
        if output.new_prompt_logprobs is not None and self.prompt_logprobs is not None:
            rows = logprobs_lists_to_dicts(output.new_prompt_logprobs, self.params.prompt_logprobs or 0,
                                           self.decode_token)
            # Positions 1..P-1 have logprobs; guard against a chunk being delivered twice.
            room = len(self.prompt_token_ids) - len(self.prompt_logprobs)
            self.prompt_logprobs.extend(rows[:max(room, 0)])
        if new_token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
            self.last_token_time = now
            self.output_token_ids.extend(new_token_ids)
        if output.new_logprobs is not None and self.logprobs is not None:
            rows = logprobs_lists_to_dicts(output.new_logprobs, self.params.logprobs or 0, self.decode_token)
            self.logprobs.extend(rows)
            assert self.cumulative_logprob is not None
            self.cumulative_logprob += sum(float(row[0]) for row in output.new_logprobs.logprobs)

        stop_string = self.detokenizer.update(new_token_ids, finished=output.finished,
                                              stop_terminated=output.finish_reason == "stop")
        if stop_string is not None:
            self.finish_reason = "stop"
            self.stop_reason = stop_string
            return True
        if output.finished:
            self.finish_reason = output.finish_reason
            self.stop_reason = output.stop_reason
        return False

    def completion_output(self, delta: bool) -> CompletionOutput:
        """This request's CompletionOutput: everything so far, or only this step's news (delta)."""
        text = self.detokenizer.get_next_output_text(self.is_finished, delta)
        start = self.step_token_start if delta else 0
        logprobs = None if self.logprobs is None else list(self.logprobs[start:])
        return CompletionOutput(index=self.index, text=text, token_ids=list(self.output_token_ids[start:]),
                                cumulative_logprob=self.cumulative_logprob, logprobs=logprobs,
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason)

    def take_prompt_logprobs(self, delta: bool) -> PromptLogprobs | None:
        """Prompt logprobs for this output: always (cumulative), or only the first time (delta)."""
        if self.prompt_logprobs is None:
            return None
        if delta:
            if self.is_prompt_logprobs_sent:
                return None
            self.is_prompt_logprobs_sent = True
        return list(self.prompt_logprobs)

    def metrics(self) -> dict[str, float]:
        metrics = {"arrival_time": self.arrival_time}
        if self.first_token_time is not None:
            metrics["first_token_time"] = self.first_token_time
        if self.last_token_time is not None:
            metrics["last_token_time"] = self.last_token_time
        return metrics


class OutputProcessor:
    """Front-end output side of the engine: EngineCoreOutputs in, RequestOutputs out.

    Engine request ids are the ids of the Requests added (children f"{i}_{id}" when n > 1); the
    RequestOutputs carry the user's (parent) id.
    """

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self._token_text_cache: dict[int, str] = {}

    def decode_token(self, token_id: int) -> str | None:
        """One token's text for Logprob.decoded_token (vLLM decodes each id alone; cached)."""
        if self.tokenizer is None:
            return None
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text_cache[token_id] = text
        return text

    def add_request(self, request_id: str, prompt: str | None, requests: list[Request], params: SamplingParams,
                    output_kind: RequestOutputKind | str = RequestOutputKind.CUMULATIVE) -> None:
        """Track one user request: the Requests InputProcessor.process made for it (n children when
        params.n > 1, fanned back in under `request_id`)."""
        if params.n != len(requests):
            raise ValueError(f"requests has {len(requests)} entries but n={params.n}")
        if params.n == 1:
            if requests[0].request_id != request_id:
                raise ValueError(f"request_id={request_id!r} does not match the Request's id "
                                 f"{requests[0].request_id!r}")
            self.add_engine_request(requests[0], prompt, output_kind=output_kind)
            return
        if request_id in self.parent_requests:
            raise ValueError(f"request_id={request_id!r} is already being processed")
        parent = ParentRequest(request_id, params)
        for index, request in enumerate(requests):
            self.add_engine_request(request, prompt, parent=parent, index=index, output_kind=output_kind)

    def add_engine_request(self, request: Request, prompt: str | None, parent: ParentRequest | None = None,
                           index: int = 0,
                           output_kind: RequestOutputKind | str = RequestOutputKind.CUMULATIVE) -> None:
        """Track one engine request; for a child of an n > 1 request pass its ParentRequest and index."""
        if request.request_id in self.request_states:
            raise ValueError(f"request_id={request.request_id!r} is already being processed")
        try:
            kind = RequestOutputKind(output_kind)
        except ValueError:
            raise ValueError(f"output_kind={output_kind!r} must be one of "
                             f"{[k.value for k in RequestOutputKind]}") from None
        if parent is not None:
            if not 0 <= index < parent.num_children:
                raise ValueError(f"index={index} must be in [0, {parent.num_children})")
            if request.request_id != parent.child_request_ids[index]:
                raise ValueError(f"request_id={request.request_id!r} is not child {index} of "
                                 f"{parent.request_id!r} (expected {parent.child_request_ids[index]!r})")
            self.parent_requests[parent.request_id] = parent
        elif index != 0:
            raise ValueError(f"index={index} must be 0 for a request without a parent")
        params = request.sampling_params
        if params.detokenize and self.tokenizer is None and params.stop:
            raise ValueError(f"stop={params.stop!r} needs a tokenizer")
        decode = self.decode_token if params.detokenize else _no_decode
        state = RequestState(request, prompt, parent, index, kind, self.tokenizer, decode)
        self.request_states[request.request_id] = state
        if parent is not None:
            parent.record_output(index, state.completion_output(delta=False))

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        """Number of unfinished user-facing requests (a parent counts once)."""
        return len({state.parent.request_id if state.parent else state.request_id
                    for state in self.request_states.values()})

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forget requests (user ids; a parent id covers all its children, a child id itself).

        Returns the engine request ids that were still unfinished, for the engine core to abort.
        No RequestOutput is produced for them.
        """
        engine_ids: list[str] = []
        for request_id in request_ids:
            parent = self.parent_requests.pop(request_id, None)
            ids = parent.child_request_ids if parent is not None else [request_id]
            for engine_id in ids:
                state = self.request_states.pop(engine_id, None)
                if state is not None:
                    engine_ids.append(engine_id)
        return engine_ids

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Fold one engine step's outputs in; return the RequestOutputs and the ids to stop."""
        result = ProcessedOutputs()
        # User-facing id -> the states with news, in first-seen order.
        updated: dict[str, list[RequestState]] = {}
        for output in outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                continue  # Aborted, or already stopped by a stop string.
            is_stopped_by_string = state.apply(output)
            if is_stopped_by_string and not output.finished:
                result.request_ids_to_abort.append(output.request_id)
            if not output.new_token_ids and not state.is_finished:
                continue  # A partial prefill chunk: nothing to show yet (prompt logprobs were kept).
            if state.is_finished:
                del self.request_states[output.request_id]
                if state.parent is not None:
                    state.parent.mark_child_finished(state.request_id)
            key = state.parent.request_id if state.parent is not None else state.request_id
            updated.setdefault(key, []).append(state)

        for key, states in updated.items():
            request_output = self._make_request_output(states)
            if request_output is not None:
                result.request_outputs.append(request_output)
        return result

    def _make_request_output(self, states: list[RequestState]) -> RequestOutput | None:
        first = states[0]
        parent = first.parent
        kind = first.output_kind
        if parent is None:
            if kind == RequestOutputKind.FINAL_ONLY and not first.is_finished:
                return None
            delta = kind == RequestOutputKind.DELTA
            return RequestOutput(
                request_id=first.request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
                outputs=[first.completion_output(delta)], finished=first.is_finished,
                prompt_logprobs=first.take_prompt_logprobs(delta), num_cached_tokens=first.num_cached_tokens,
                metrics=first.metrics(), kv_transfer_params=first.kv_transfer_params)

        # n > 1: keep every child's latest cumulative output on the parent.
        delta = kind == RequestOutputKind.DELTA
        delta_outputs: list[CompletionOutput] = []
        for state in sorted(states, key=lambda s: s.index):
            if delta:
                delta_outputs.append(state.completion_output(delta=True))
            else:
                parent.record_output(state.index, state.completion_output(delta=False))
        finished = parent.is_finished
        if finished:
            self.parent_requests.pop(parent.request_id, None)
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        # Prompt logprobs live on child 0 only (see ParentRequest.child_sampling_params).
        child_zero = next((s for s in states if s.index == 0), None)
        if child_zero is not None and child_zero.prompt_logprobs is not None:
            parent.prompt_logprobs = list(child_zero.prompt_logprobs)
        if delta:
            prompt_logprobs = child_zero.take_prompt_logprobs(delta=True) if child_zero is not None else None
        else:
            prompt_logprobs = None if parent.prompt_logprobs is None else list(parent.prompt_logprobs)
        return RequestOutput(
            request_id=parent.request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=delta_outputs if delta else parent.all_outputs(), finished=finished,
            prompt_logprobs=prompt_logprobs, num_cached_tokens=max(s.num_cached_tokens for s in states),
            metrics=first.metrics())


def _no_decode(token_id: int) -> str | None:
    return None
