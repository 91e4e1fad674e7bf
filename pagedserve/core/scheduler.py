"""Scheduler: decides, each step, which requests compute how many tokens (vLLM v1 rules).

There is no prefill or decode phase. Every request has `num_computed_tokens` and `num_tokens`
(prompt + generated); each step the scheduler lets computed tokens catch up with known tokens under
one token budget. Running requests are served first, in order; waiting requests are admitted with the
rest of the budget. When the KV cache runs out, running requests are preempted by recompute: their
blocks are freed and they go back to the waiting queue with `num_computed_tokens = 0`.

Async scheduling (the engine keeps up to N steps in flight) adds one rule: a token sampled by a step
still in flight counts as a placeholder (`Request.num_output_placeholders`), so a running request whose
last step samples can be given its next decode step at once; the worker feeds it the token it sampled
itself (steps run in order on the worker). Outputs that come back for a request that finished
meanwhile are dropped; a request preempted meanwhile still receives its token (it joins the tokens to
recompute), and is not admitted again until every output in flight for it is back.

A KV connector (kv_transfer/, optional) plugs in through its scheduler side: at admission it may provide a
request's KV from another engine; an asynchronous load parks the request, with its blocks, in
WAITING_FOR_REMOTE_KVS until the worker reports the load ended (then it is admitted with its prompt computed but
the last token). A finished request whose blocks the connector still needs keeps them until the worker reports
it done.

Pure Python: no torch, no device code. The scheduler sees KV blocks only through KVCacheManager.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pagedserve.core.engine_core_output import EngineCoreOutput, SchedulerStats
from pagedserve.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from pagedserve.core.prefill_chunk_policy import PrefillChunkPolicy, UncappedPrefillChunkPolicy
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.request_queue import create_request_queue
from pagedserve.core.spec_decode_stats import SpecDecodeStats
from pagedserve.kv_transfer.kv_transfer_params import check_kv_transfer_params_accepted
from pagedserve.core.scheduler_output import (
    CachedRequestData,
    KVConnectorOutput,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

if TYPE_CHECKING:  # the config package imports torch; core stays importable without it
    from pagedserve.config.scheduler import SchedulerConfig
    from pagedserve.kv_transfer.connector_base import KVConnectorScheduler
    from pagedserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler:
    """Continuous batching with chunked prefill, prefix caching and preemption by recompute."""

    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager, block_size: int,
                 prefill_chunk_policy: PrefillChunkPolicy | None = None,
                 include_new_token_ids: bool = False, num_lookahead_tokens: int = 0,
                 kv_connector: KVConnectorScheduler | None = None, kv_load_failure_policy: str = "recompute",
                 structured_output_manager: StructuredOutputManager | None = None) -> None:
        """`include_new_token_ids`: send the generated tokens each step computes in its cached-request
        deltas (pipeline parallel: only the last stage samples; the other stages learn the tokens there).
        `kv_connector`: a KV connector's scheduler side; `kv_load_failure_policy` ('recompute' | 'fail'): what
        happens to a request whose remote KV did not arrive. `structured_output_manager`: grammars and matchers of
        requests with structured outputs (None: such requests are refused)."""
        if block_size != kv_cache_manager.block_size:
            raise ValueError(
                f"block_size={block_size} must equal the KV cache manager's block_size={kv_cache_manager.block_size}")
        self.scheduler_config = scheduler_config
        self.kv_cache_manager = kv_cache_manager
        self.block_size = block_size
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.policy = scheduler_config.policy
        # Schedule a request again while its sampled token is still in flight (see the module docstring).
        self.async_scheduling = scheduler_config.async_scheduling
        # Caps each prefill chunk (chunked prefill only); the default adds no cap.
        self.prefill_chunk_policy = prefill_chunk_policy or UncappedPrefillChunkPolicy()
        self.include_new_token_ids = include_new_token_ids
        # KV slots reserved past each step's tokens: a speculative draft model writes its drafts' KV there.
        self.num_lookahead_tokens = num_lookahead_tokens
        # Structured outputs (structured_output/): a constrained request waits until its grammar is compiled, is
        # scheduled only with all its tokens back (its bitmask needs them), and its matcher sees every token.
        self.structured_output_manager = structured_output_manager
        # Outputs of requests finished outside a step (a grammar that failed to compile), sent with the next one.
        self._pending_outputs: list[EngineCoreOutput] = []
        # The requests whose next token the step being scheduled samples (set by _make_output).
        self._sampling_request_ids: list[str] = []
        # Tokens of this step a prefill chunk shares it with (running decodes + chunks already taken).
        self._num_other_step_tokens = 0

        # Every unfinished request, by id. Finished requests are dropped at once.
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished (or aborted) since the last schedule(): the worker must drop their state.
        self.finished_request_ids: set[str] = set()
        self.num_preemptions = 0
        self.spec_decode_stats = SpecDecodeStats()
        self.kv_connector = kv_connector
        self.kv_load_failure_policy = kv_load_failure_policy
        # Requests in WAITING_FOR_REMOTE_KVS, by id (out of the waiting queue until their load ends).
        self.remote_kv_requests: dict[str, Request] = {}
        # Finished requests whose blocks the connector still needs, by id (freed when the worker says so).
        self.kv_held_requests: dict[str, Request] = {}
        # Requests in WAITING_FOR_REMOTE_KVS, by id -> the computed tokens they have once their load arrived.
        self._num_remote_kv_tokens: dict[str, int] = {}
        # The KV connector's prefix lookups (vLLM's external prefix cache counters): tokens of the requests it was
        # asked about at admission, and tokens it provided.
        self.external_prefix_cache_queries = 0
        self.external_prefix_cache_hits = 0

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a new request. Its prompt must hold between 1 and max_model_len tokens."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already scheduled; ids must be unique")
        if request.request_id in self.kv_held_requests:
            # Finished, but its blocks are held for the KV connector under this id: a new request under the same id
            # would mix its blocks (and a consumer's transfer) with the held ones.
            raise ValueError(f"request_id={request.request_id!r} is still in use: the KV connector holds the blocks "
                             f"of the finished request with this id; ids must be unique")
        if not 1 <= request.num_prompt_tokens <= self.max_model_len:
            raise ValueError(
                f"prompt length={request.num_prompt_tokens} of request {request.request_id!r} must be in "
                f"[1, max_model_len={self.max_model_len}]")
        check_kv_transfer_params_accepted(request.sampling_params.extra_args, self.kv_connector is not None)
        structured_outputs = request.sampling_params.structured_outputs
        if structured_outputs is not None:
            if self.structured_output_manager is None:
                raise ValueError(f"request {request.request_id!r} asks for structured_outputs, but this engine "
                                 f"has no structured output manager")
            self.structured_output_manager.add_request(request.request_id, structured_outputs,
                                                       request.prompt_token_ids)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add_request(request)

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish requests from outside the scheduler (abort, or a stop string seen by the front end).

        Works at any time: waiting, running or mid-prefill. Their blocks are freed at once. Unknown or
        already-finished ids are ignored.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status={finished_status!r} must be a FINISHED_* status")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        running_to_remove: set[Request] = set()
        waiting_to_remove: list[Request] = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                running_to_remove.add(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.remote_kv_requests[request_id]
                self._num_remote_kv_tokens.pop(request_id, None)
            else:
                waiting_to_remove.append(request)
            request.status = finished_status
            self._free_request(request)
        if running_to_remove:
            self.running = [request for request in self.running if request not in running_to_remove]
        if waiting_to_remove:
            self.waiting.remove_requests(waiting_to_remove)

    def _free_request(self, request: Request) -> dict[str, Any] | None:
        """Forget a finished request and free its blocks, unless the KV connector still needs them; returns the
        connector's kv_transfer_params for the request's output (None without)."""
        is_delayed, kv_transfer_params = False, None
        if self.kv_connector is not None:
            is_delayed, kv_transfer_params = self.kv_connector.request_finished(
                request, self.kv_cache_manager.get_block_ids(request.request_id))
        if is_delayed:
            self.kv_held_requests[request.request_id] = request
        else:
            self.kv_cache_manager.free(request)
        if self.structured_output_manager is not None and request.sampling_params.structured_outputs is not None:
            self.structured_output_manager.free(request.request_id)
        self.finished_request_ids.add(request.request_id)
        del self.requests[request.request_id]
        return kv_transfer_params

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.remote_kv_requests)

    def has_kv_held_requests(self) -> bool:
        """Finished requests still hold blocks for the KV connector (steps must run until it releases them)."""
        return bool(self.kv_held_requests)

    def make_stats(self) -> SchedulerStats:
        """Gauges of this moment plus cumulative counters."""
        prefix_cache_stats = self.kv_cache_manager.make_prefix_cache_stats()
        return SchedulerStats(
            num_running_requests=len(self.running),
            num_waiting_requests=len(self.waiting) + len(self.remote_kv_requests),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix_cache_stats.queries,
            prefix_cache_hits=prefix_cache_stats.hits,
            external_prefix_cache_queries=self.external_prefix_cache_queries,
            external_prefix_cache_hits=self.external_prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            spec_decode_num_drafts=self.spec_decode_stats.num_drafts,
            spec_decode_num_draft_tokens=self.spec_decode_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_decode_stats.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.spec_decode_stats.num_accepted_tokens_per_pos),
        )

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        """Pick the requests and token counts of the next step and reserve their KV slots.

        Running requests first, in order; each gets as many tokens as it lacks, within the budget. If
        its blocks cannot be allocated, running requests are preempted (FCFS: the newest; priority: the
        one with the largest (priority, arrival_time)) until they can, or until the request itself was
        preempted. Waiting requests are admitted only when nothing was preempted this step. Each
        scheduled request's num_computed_tokens is advanced by its scheduled tokens before returning.
        """
        token_budget = self.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        preempted: list[Request] = []
        scheduled_spec_decode_tokens: dict[str, list[int]] = {}
        self._num_other_step_tokens = sum(
            1 for request in self.running if self._num_pending_tokens(request) - request.num_computed_tokens == 1)

        # 1. Running requests.
        request_index = 0
        while request_index < len(self.running) and token_budget > 0:
            request = self.running[request_index]
            num_new_tokens = self._num_tokens_to_schedule(request, request.num_computed_tokens, token_budget)
            if num_new_tokens == 0:
                request_index += 1
                continue
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, num_lookahead_tokens=self._num_lookahead(request, num_new_tokens))
                if new_blocks is not None:
                    break
                victim = self._pick_preemption_victim()
                self.running.remove(victim)
                if victim in scheduled_running:
                    # Priority policy only: the victim was scheduled earlier in this step; undo that.
                    scheduled_running.remove(victim)
                    token_budget += num_scheduled_tokens.pop(victim.request_id)
                    del new_block_ids[victim.request_id]
                    scheduled_spec_decode_tokens.pop(victim.request_id, None)
                    request_index -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break
            scheduled_running.append(request)
            # Tokens past the known ones (placeholders of steps in flight count as known) are drafts.
            num_spec_tokens = request.num_computed_tokens + num_new_tokens - self._num_pending_tokens(request)
            if num_new_tokens > 1:
                # A decode with drafts was counted as one token already (the sum above).
                is_decode = self._num_pending_tokens(request) - request.num_computed_tokens == 1
                self._num_other_step_tokens += num_new_tokens - (1 if is_decode else 0)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            if num_spec_tokens > 0 and request.spec_token_ids:
                scheduled_spec_decode_tokens[request.request_id] = request.spec_token_ids[:num_spec_tokens]
            new_block_ids[request.request_id] = new_blocks.get_block_ids()
            token_budget -= num_new_tokens
            request_index += 1

        # 2. Waiting requests (new or preempted), only if the cache did not just run out.
        waiting_for_grammar: list[Request] = []
        if not preempted:
            while len(self.waiting) > 0 and token_budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting.peek_request()
                if request.num_output_placeholders:
                    break  # preempted with a step in flight: its token must come back first
                if request.sampling_params.structured_outputs is not None and not self._is_grammar_ready(request):
                    if not request.is_finished():
                        # Its grammar is still compiling: the requests behind it go first; it keeps its place.
                        waiting_for_grammar.append(self.waiting.pop_request())
                    continue
                num_new_tokens = self._admit(request, token_budget)
                if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    self.waiting.pop_request()
                    self.remote_kv_requests[request.request_id] = request
                    continue
                if num_new_tokens == 0:
                    break
                self.waiting.pop_request()
                self.running.append(request)
                scheduled_new.append(request)
                if num_new_tokens > 1:
                    self._num_other_step_tokens += num_new_tokens
                num_scheduled_tokens[request.request_id] = num_new_tokens
                token_budget -= num_new_tokens
        for request in reversed(waiting_for_grammar):
            self.waiting.prepend_request(request)

        output = self._make_output(scheduled_new, scheduled_running, num_scheduled_tokens, new_block_ids, preempted)
        output.scheduled_spec_decode_tokens = scheduled_spec_decode_tokens
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_connector_meta(output)
        if self.structured_output_manager is not None and self._sampling_request_ids:
            output.grammar_bitmask = self.structured_output_manager.grammar_bitmask(
                [(request_id, scheduled_spec_decode_tokens.get(request_id, []))
                 for request_id in self._sampling_request_ids
                 if self.requests[request_id].sampling_params.structured_outputs is not None])
        return output

    def _is_grammar_ready(self, request: Request) -> bool:
        """Whether the constrained request at the head of the waiting queue can be admitted; one whose grammar
        failed leaves the queue here, finished with finish_reason='error' (its output goes out with the next
        step's)."""
        manager = self.structured_output_manager
        assert manager is not None
        if not manager.is_ready(request.request_id):
            return False
        error = manager.error(request.request_id)
        if error is None:
            return True
        self.waiting.pop_request()
        request.status = RequestStatus.FINISHED_ERROR
        request.stop_reason = error
        self._free_request(request)
        self._pending_outputs.append(EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                                      finish_reason=request.get_finish_reason(),
                                                      stop_reason=error))
        return False

    def _num_tokens_to_schedule(self, request: Request, num_computed_tokens: int, token_budget: int) -> int:
        """Tokens the request lacks, capped by the budget, the long-prefill threshold and max_model_len.

        Placeholders (tokens sampled by steps in flight) count as known; a request whose pending tokens
        already reach max_tokens or max_model_len gets nothing more (its last token is on its way).
        """
        num_pending_tokens = self._num_pending_tokens(request)
        if num_pending_tokens > request.num_tokens and (
                num_pending_tokens >= self.max_model_len
                or (request.sampling_params.max_tokens is not None
                    and request.num_output_tokens + request.num_output_placeholders
                    >= request.sampling_params.max_tokens)):
            return 0
        num_new_tokens = num_pending_tokens - num_computed_tokens
        if self.long_prefill_token_threshold > 0:
            num_new_tokens = min(num_new_tokens, self.long_prefill_token_threshold)
        # No position may reach max_model_len (add_request bounds the prompt, the stop check the rest).
        num_new_tokens = min(num_new_tokens, self.max_model_len - num_computed_tokens)
        num_new_tokens = max(0, min(num_new_tokens, token_budget))
        if num_new_tokens > 1 and self.enable_chunked_prefill:  # a prefill chunk: the policy may cap it
            cap = self.prefill_chunk_policy.prefill_token_cap(self._num_other_step_tokens, num_computed_tokens)
            if cap is not None:
                num_new_tokens = min(num_new_tokens, cap)
        if request.spec_token_ids and num_computed_tokens + num_new_tokens == num_pending_tokens:
            # The step reaches the last known token: its drafts follow, as many as the budget and
            # max_model_len leave room for (the sampler verifies those scheduled).
            num_new_tokens += max(0, min(len(request.spec_token_ids), token_budget - num_new_tokens,
                                         self.max_model_len - num_computed_tokens - num_new_tokens))
        return num_new_tokens

    def _num_pending_tokens(self, request: Request) -> int:
        """Known tokens plus, with async scheduling, the placeholders of tokens sampled by steps in flight.

        Without async scheduling a request whose sampled token is in flight (pipeline micro-batches) has
        nothing to compute until it comes back."""
        if self.async_scheduling and request.sampling_params.structured_outputs is None:
            return request.num_tokens + request.num_output_placeholders
        # A constrained request's next bitmask needs the matcher past every token: it waits for them.
        return request.num_tokens

    def _admit(self, request: Request, token_budget: int) -> int:
        """Try to move a waiting request to running; returns its scheduled tokens (0: not admitted). A request
        whose KV the connector loads asynchronously is parked instead (status WAITING_FOR_REMOTE_KVS, 0)."""
        is_queried = False
        if self.kv_connector is not None and self.kv_cache_manager.get_block_ids(request.request_id):
            # Its remote KV load ended: its blocks hold the prompt's KV up to num_computed_tokens.
            hit_blocks, num_hit_tokens = KVCacheBlocks(), 0
        else:
            hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            if self.kv_connector is not None:
                num_external_tokens, is_async = self.kv_connector.get_num_new_matched_tokens(
                    request, request.num_computed_tokens + num_hit_tokens)
                if is_async and num_external_tokens > 0:
                    if self._wait_for_remote_kv(request, hit_blocks, num_hit_tokens, num_external_tokens):
                        self.external_prefix_cache_queries += request.num_tokens
                        self.external_prefix_cache_hits += num_external_tokens
                    return 0
                is_queried = True
        num_computed_tokens = request.num_computed_tokens + num_hit_tokens
        num_lacking_tokens = request.num_tokens - num_computed_tokens
        if not self.enable_chunked_prefill and num_lacking_tokens > token_budget:
            return 0  # the whole remaining prompt must fit in one step
        num_new_tokens = self._num_tokens_to_schedule(request, num_computed_tokens, token_budget)
        if num_new_tokens == 0:
            return 0
        new_blocks = self.kv_cache_manager.allocate_slots(
            request, num_new_tokens, hit_blocks, num_hit_tokens,
            self._num_lookahead(request, num_new_tokens, num_computed_tokens))
        if new_blocks is None:
            return 0
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed_tokens
        if is_queried:  # counted once the request is admitted (a request that did not fit is asked again)
            self.external_prefix_cache_queries += request.num_tokens
        if request.num_cached_tokens < 0:  # first admission only; a resumed request keeps its first figure
            request.num_cached_tokens = num_hit_tokens
        return num_new_tokens

    def _wait_for_remote_kv(self, request: Request, hit_blocks: KVCacheBlocks, num_hit_tokens: int,
                            num_external_tokens: int) -> bool:
        """Allocate the blocks the connector loads into (kept out of the prefix cache until the KV is there) and
        park the request; it stays WAITING (not admitted, False) when the blocks do not fit now."""
        assert self.kv_connector is not None
        new_blocks = self.kv_cache_manager.allocate_slots(request, num_external_tokens, hit_blocks, num_hit_tokens,
                                                          delay_cache_blocks=True)
        if new_blocks is None:
            return False
        request.num_computed_tokens += num_hit_tokens
        self._num_remote_kv_tokens[request.request_id] = request.num_computed_tokens + num_external_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.kv_connector.update_state_after_alloc(
            request, self.kv_cache_manager.get_block_ids(request.request_id), num_external_tokens)
        return True

    def _update_from_kv_connector_output(self, connector_output: KVConnectorOutput) -> list[EngineCoreOutput]:
        """Free the blocks the connector released; resume (or, per kv_load_failure_policy, fail) the requests
        whose load ended. Returns the outputs of the requests failed here."""
        assert self.kv_connector is not None
        self.kv_connector.update_connector_output(connector_output)
        outputs: list[EngineCoreOutput] = []
        for request_id in connector_output.finished_sending | connector_output.finished_recving:
            held = self.kv_held_requests.pop(request_id, None)
            if held is not None:
                self.kv_cache_manager.free(held)
        for request_id in connector_output.finished_recving:
            request = self.remote_kv_requests.pop(request_id, None)
            num_remote_kv_tokens = self._num_remote_kv_tokens.pop(request_id, None)
            if request is None or num_remote_kv_tokens is None:
                continue
            block_ids = self.kv_cache_manager.get_block_ids(request_id)
            first_invalid = next((index for index, block_id in enumerate(block_ids)
                                  if block_id in connector_output.invalid_block_ids), None)
            if (first_invalid is not None and self.kv_load_failure_policy == "fail"
                    and not self.kv_connector.recomputes_failed_loads(request_id)):
                request.status = RequestStatus.FINISHED_ERROR
                self._free_request(request)
                outputs.append(EngineCoreOutput(request_id=request_id, new_token_ids=[], finish_reason="error",
                                                num_cached_tokens=max(request.num_cached_tokens, 0)))
                continue
            # The last prompt token is computed here (its logits give the first token); recompute starts at the
            # first block whose KV did not arrive. A connector may provide only part of the prompt (a pool).
            num_loaded_tokens = min(request.num_prompt_tokens - 1, num_remote_kv_tokens)
            if first_invalid is not None:
                num_loaded_tokens = min(num_loaded_tokens, first_invalid * self.block_size)
            request.num_computed_tokens = max(request.num_computed_tokens, num_loaded_tokens)
            request.status = RequestStatus.WAITING
            self.waiting.prepend_request(request)
        return outputs

    def _num_lookahead(self, request: Request, num_new_tokens: int, num_computed_tokens: int | None = None) -> int:
        """Lookahead slots for a step of `num_new_tokens`: none for a prefill chunk that stops short of the
        known tokens (it samples nothing, so nothing is drafted), never past max_model_len."""
        if not self.num_lookahead_tokens:
            return 0
        computed = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        if computed + num_new_tokens < request.num_tokens:
            return 0
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - computed - num_new_tokens))

    def _pick_preemption_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda request: (request.priority, request.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: free the blocks, forget the computed tokens, wait again."""
        self.kv_cache_manager.free(request)  # before resetting num_computed_tokens: free() reads it
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []  # drafted for KV that is gone; the resumed request drafts again
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    def _make_output(
        self,
        scheduled_new: list[Request],
        scheduled_running: list[Request],
        num_scheduled_tokens: dict[str, int],
        new_block_ids: dict[str, list[int]],
        preempted: list[Request],
    ) -> SchedulerOutput:
        # Data carries num_computed_tokens as it was before this step (where this step's tokens start).
        new_requests_data = [
            NewRequestData(
                request_id=request.request_id,
                token_ids=request.all_token_ids,  # a fresh list
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=request.sampling_params,
                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                num_computed_tokens=request.num_computed_tokens,
            )
            for request in scheduled_new
        ]
        cached_requests_data = CachedRequestData(
            request_ids=[request.request_id for request in scheduled_running],
            new_block_ids=[new_block_ids[request.request_id] for request in scheduled_running],
            num_computed_tokens=[request.num_computed_tokens for request in scheduled_running],
            new_token_ids=[_generated_tokens_to_compute(request, num_scheduled_tokens[request.request_id])
                           for request in scheduled_running] if self.include_new_token_ids else [],
        )
        sampling_request_ids = self._sampling_request_ids = []
        for request in (*scheduled_running, *scheduled_new):
            request.num_computed_tokens += num_scheduled_tokens[request.request_id]
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                # This step samples the request's next token (and, past it, verifies drafts): one placeholder
                # until update_from_output.
                request.num_output_placeholders += 1
                sampling_request_ids.append(request.request_id)

        output = SchedulerOutput(
            scheduled_new_requests=new_requests_data,
            scheduled_cached_requests=cached_requests_data,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            finished_request_ids=self.finished_request_ids,
            preempted_request_ids={request.request_id for request in preempted},
        )
        self.finished_request_ids = set()
        return output

    # ------------------------------------------------------------------ model output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests, report per request.

        An output is emitted for each request that got tokens or prompt logprobs, or finished.
        Requests finished between schedule() and this call (aborts, or a stop found in an earlier
        step's output while this one was in flight) are skipped: their blocks were freed then, once.
        A request preempted while this step was in flight still takes its token (async scheduling).
        """
        index_of = {request_id: index for index, request_id in enumerate(model_runner_output.request_ids)}
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.kv_connector is not None and model_runner_output.kv_connector_output is not None:
            outputs += self._update_from_kv_connector_output(model_runner_output.kv_connector_output)
        manager = self.structured_output_manager
        stopped: set[Request] = set()
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue
            index = index_of.get(request_id)
            sampled_token_ids = model_runner_output.sampled_token_ids[index] if index is not None else []
            if sampled_token_ids:
                request.num_output_placeholders -= 1
            num_spec_tokens = len(scheduler_output.scheduled_spec_decode_tokens.get(request_id, ()))
            if num_spec_tokens and sampled_token_ids:
                self.spec_decode_stats.observe(num_spec_tokens, len(sampled_token_ids) - 1)
            was_running = request.status == RequestStatus.RUNNING
            new_token_ids: list[int] = []
            is_constrained = manager is not None and request.sampling_params.structured_outputs is not None
            for token_id in sampled_token_ids:
                if is_constrained and not manager.accept_token(request_id, token_id):
                    # The bitmask allowed no token (e.g. min_tokens masked the only one the grammar allowed).
                    logger.error("request %s: token %d is not allowed by its structured output grammar",
                                 request_id, token_id)
                    request.status = RequestStatus.FINISHED_ERROR
                    request.stop_reason = f"token {token_id} violates the structured output grammar"
                    break
                request.append_output_token_ids([token_id])
                new_token_ids.append(token_id)
                if self._check_stop(request):
                    break  # tokens after a stop (speculative decoding) are dropped
            if num_spec_tokens and new_token_ids:
                # The step computed its last known token and its drafts; KV stays valid for the inputs that turned
                # out to be tokens (all but the newest kept one). Rejected drafts' slots are written again later.
                request.num_computed_tokens -= num_spec_tokens + 1 - len(new_token_ids)
            logprobs = model_runner_output.logprobs.get(request_id)
            if logprobs is not None and new_token_ids and len(new_token_ids) < len(sampled_token_ids):
                logprobs = _truncate_logprobs(logprobs, len(new_token_ids))
            prompt_logprobs = model_runner_output.prompt_logprobs.get(request_id)
            is_finished = request.is_finished()
            kv_transfer_params = None
            if is_finished:
                if was_running:
                    stopped.add(request)
                else:  # preempted while this step was in flight: it waits for recompute
                    self.waiting.remove_requests([request])
                kv_transfer_params = self._free_request(request)
            elif index is not None and model_runner_output.spec_token_ids:
                self._set_drafts(request, model_runner_output.spec_token_ids[index])
            if new_token_ids or prompt_logprobs is not None or is_finished:
                outputs.append(EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=logprobs if new_token_ids else None,
                    new_prompt_logprobs=prompt_logprobs,
                    finish_reason=request.get_finish_reason(),
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    kv_transfer_params=kv_transfer_params,
                ))
        if stopped:
            self.running = [request for request in self.running if request not in stopped]
        return outputs

    def _set_drafts(self, request: Request, draft_token_ids: list[int]) -> None:
        """Keep the drafts the next step verifies, at most as many as max_tokens and max_model_len leave room for
        (a step emits its accepted drafts plus one token)."""
        num_room = self.max_model_len - request.num_tokens - 1
        if request.sampling_params.max_tokens is not None:
            num_room = min(num_room, request.sampling_params.max_tokens - request.num_output_tokens - 1)
        draft_token_ids = draft_token_ids[:max(num_room, 0)]
        if self.structured_output_manager is not None and request.sampling_params.structured_outputs is not None \
                and draft_token_ids:
            # Drafts the grammar forbids would be rejected anyway: only the valid prefix is verified.
            draft_token_ids = self.structured_output_manager.valid_draft_prefix(request.request_id, draft_token_ids)
        request.spec_token_ids = draft_token_ids

    def _check_stop(self, request: Request) -> bool:
        """Apply the stop conditions to the last appended token; sets status and stop_reason on a stop."""
        sampling_params = request.sampling_params
        last_token_id = request.output_token_ids[-1]
        if request.num_output_tokens >= sampling_params.min_tokens:
            if last_token_id in sampling_params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last_token_id
                return True
            is_eos = last_token_id == request.eos_token_id or last_token_id in sampling_params.all_stop_token_ids
            if is_eos and not sampling_params.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
        max_tokens = sampling_params.max_tokens
        if max_tokens is not None and request.num_output_tokens >= max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False


def _generated_tokens_to_compute(request: Request, num_scheduled_tokens: int) -> list[int]:
    """The generated tokens among the positions a step computes, from position
    max(num_computed_tokens, num_prompt_tokens) (CachedRequestData.new_token_ids)."""
    start = max(request.num_computed_tokens - request.num_prompt_tokens, 0)
    return request.output_token_ids[start:request.num_computed_tokens + num_scheduled_tokens
                                    - request.num_prompt_tokens]


def _truncate_logprobs(logprobs: LogprobsLists, num_rows: int) -> LogprobsLists:
    """Keep the logprob rows of the first `num_rows` sampled tokens."""
    return LogprobsLists(
        logprob_token_ids=logprobs.logprob_token_ids[:num_rows],
        logprobs=logprobs.logprobs[:num_rows],
        sampled_token_ranks=logprobs.sampled_token_ranks[:num_rows],
    )
