"""PullConnector in push mode (kv_connector_extra_config.mode "push"), scheduler side.

Consumer (D): as in pull mode, a request with kv_transfer_params.do_remote_prefill gets blocks for its whole prompt
and waits in WAITING_FOR_REMOTE_KVS; its load order names P's request (remote_request_id), and D's worker tells P
where the blocks are (push_connector_worker.py). D may be sent the request before P computes it: its
remote_block_ids may be empty (P writes into D's blocks, so D never names P's).
Producer (P): besides pull mode's held blocks, each step's orders carry a SaveOrder per do_remote_decode request the
step computes prompt tokens for: its blocks and the prompt tokens written before and after the step, so that P's
worker sends each layer's new blocks from save_kv_layer, during the forward.
Pure Python (it runs inside the scheduler).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.kv_transfer.kv_transfer_params import KVTransferParams, request_kv_transfer_params
from pagedserve.kv_transfer.pull_connector_scheduler import PullConnectorMetadata, PullConnectorScheduler

if TYPE_CHECKING:
    from pagedserve.core.request import Request
    from pagedserve.core.scheduler_output import SchedulerOutput
    from pagedserve.sampling_params import SamplingParams


@dataclass
class SaveOrder:
    """This step computes prompt tokens [num_tokens_before, num_tokens_after) of producer request `request_id`,
    whose blocks (by position) are `block_ids`; the prompt has `num_prompt_tokens` tokens."""

    request_id: str
    block_ids: list[int]
    num_tokens_before: int
    num_tokens_after: int
    num_prompt_tokens: int

    @property
    def completes_prompt(self) -> bool:
        return self.num_tokens_after >= self.num_prompt_tokens


@dataclass
class PushConnectorMetadata(PullConnectorMetadata):
    """One step's orders: pull mode's, plus the producer's layer-wise saves."""

    saves: list[SaveOrder] = field(default_factory=list)
    # Producer: do_remote_decode requests that ended without their KV (aborted, failed), their blocks held until the
    # worker told their consumers (it reports them in finished_sending then).
    aborted: list[str] = field(default_factory=list)


@dataclass
class _ProducerRequest:
    block_ids: list[int]
    num_prompt_tokens: int


class PushConnectorScheduler(PullConnectorScheduler):
    """Pull mode's scheduler side, plus the producer's per-step SaveOrders (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        # Producer: do_remote_decode requests the worker has seen, by id -> their blocks so far (the scheduler's
        # outputs carry only new blocks for requests already scheduled).
        self._producer_requests: dict[str, _ProducerRequest] = {}
        self._aborted: list[str] = []

    @staticmethod
    def _is_remote_decode(sampling_params: SamplingParams) -> bool:
        value = request_kv_transfer_params(sampling_params.extra_args)
        return value is not None and KVTransferParams.parse(value, sampling_params.max_tokens).do_remote_decode

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PushConnectorMetadata:
        pull = super().build_connector_meta(scheduler_output)
        metadata = PushConnectorMetadata(loads=pull.loads, sends=pull.sends,
                                         finished_request_ids=pull.finished_request_ids, aborted=self._aborted)
        self._aborted = []
        for request_id in scheduler_output.finished_request_ids | scheduler_output.preempted_request_ids:
            self._producer_requests.pop(request_id, None)
        if not self.config.is_producer:
            return metadata
        num_computed: dict[str, int] = {}
        for new_request in scheduler_output.scheduled_new_requests:
            if self._is_remote_decode(new_request.sampling_params):
                # A new request, or one preempted and rescheduled: its whole block table comes again.
                self._producer_requests[new_request.request_id] = _ProducerRequest(
                    list(new_request.block_ids), new_request.num_prompt_tokens)
                num_computed[new_request.request_id] = new_request.num_computed_tokens
        cached = scheduler_output.scheduled_cached_requests
        for index, request_id in enumerate(cached.request_ids):
            state = self._producer_requests.get(request_id)
            if state is not None:
                state.block_ids.extend(cached.new_block_ids[index])
                num_computed[request_id] = cached.num_computed_tokens[index]
        for request_id, before in num_computed.items():
            state = self._producer_requests[request_id]
            after = min(before + scheduler_output.num_scheduled_tokens.get(request_id, 0), state.num_prompt_tokens)
            if after > before:  # only prompt tokens travel; the sampled token's KV is D's to compute
                metadata.saves.append(SaveOrder(request_id, list(state.block_ids), before, after,
                                                state.num_prompt_tokens))
        return metadata

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        is_delayed, params = super().request_finished(request, block_ids)
        if is_delayed or not self.config.is_producer or not self._is_remote_decode(request.sampling_params):
            return is_delayed, params
        # Ended without its KV (aborted, or failed): a consumer may be waiting for its layers. Holding the blocks
        # keeps the engine stepping (an idle engine would not) until the worker has told the consumers, and keeps
        # the blocks that layer messages still queued read from out of other requests' hands meanwhile.
        self._aborted.append(request.request_id)
        return True, None


__all__ = ["PushConnectorMetadata", "PushConnectorScheduler", "SaveOrder"]
