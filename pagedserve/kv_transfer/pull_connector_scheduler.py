"""PullConnector, scheduler side: which requests pull remote KV (consumer) and which keep their blocks (producer).

Consumer (D): a request with kv_transfer_params.do_remote_prefill gets blocks for its whole prompt; the blocks past
the local prefix hit are ordered loaded from the producer's blocks at the same positions (remote_block_ids). The
request waits in WAITING_FOR_REMOTE_KVS until the worker reports the load ended; its last prompt token is then
computed locally (for the logits of its first token). A load is ordered once per request: after a preemption the
request recomputes.
Producer (P): a request with kv_transfer_params.do_remote_decode that finishes normally keeps its blocks; its
output carries the kv_transfer_params a consumer needs. The worker reports it finished_sending when the consumer
says it is done (or free_timeout_s after it finished), and the scheduler frees the blocks then.
Pure Python (it runs inside the scheduler).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.kv_transfer.connector_base import KVConnectorScheduler
from pagedserve.kv_transfer.kv_transfer_params import KVTransferParams, request_kv_transfer_params

if TYPE_CHECKING:
    from pagedserve.config.kv_transfer import KVTransferConfig
    from pagedserve.core.request import Request
    from pagedserve.core.scheduler_output import KVConnectorOutput, SchedulerOutput


@dataclass
class LoadOrder:
    """Pull `remote_block_ids` of `remote_request_id` at the producer into `local_block_ids` (same positions)."""

    request_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    # Every producer rank's block server port, in rank order (pp_rank * tp_size + tp_rank); [remote_port] for one.
    remote_ports: list[int] = field(default_factory=list)
    # The position (block index in the prompt) of local_block_ids[0]: blocks before it were a local prefix hit.
    first_block: int = 0


@dataclass
class PullConnectorMetadata:
    """One step's orders for the worker side."""

    loads: list[LoadOrder] = field(default_factory=list)
    # Producer: requests whose blocks are now held for a consumer (the worker times them out).
    sends: list[str] = field(default_factory=list)
    # Requests finished in the scheduler since the last step: a load still running for one is cancelled.
    finished_request_ids: list[str] = field(default_factory=list)


class PullConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, block_size: int, host: str, ports: list[int]) -> None:
        """`host` / `ports`: where this engine's workers serve their blocks, one port per rank in rank order
        (producer; unused by a consumer)."""
        self.config = config
        self.block_size = block_size
        self.host = host
        self.ports = list(ports)
        self._loads: list[LoadOrder] = []
        self._sends: list[str] = []
        # Requests whose load was ordered and has not been reported ended yet.
        self._loading_ids: set[str] = set()
        # Requests whose remote KV was already asked for (never twice: a preempted one recomputes).
        self._handled_ids: set[str] = set()

    def _params(self, request: Request) -> KVTransferParams | None:
        value = request_kv_transfer_params(request.sampling_params.extra_args)
        if value is None:
            return None
        return KVTransferParams.parse(value, request.sampling_params.max_tokens)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.config.is_consumer or request.request_id in self._handled_ids:
            return 0, False
        params = self._params(request)
        if params is None or not params.do_remote_prefill:
            return 0, False
        num_external_tokens = request.num_prompt_tokens - num_computed_tokens
        return (num_external_tokens, True) if num_external_tokens > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        # Marked only now: a request whose blocks did not fit is asked again at its next admission.
        self._handled_ids.add(request.request_id)
        params = self._params(request)
        assert params is not None and params.do_remote_prefill
        first = request.num_computed_tokens // self.block_size
        end = -(-request.num_prompt_tokens // self.block_size)
        self._loads.append(LoadOrder(
            request_id=request.request_id, local_block_ids=list(block_ids[first:end]),
            remote_block_ids=list(params.remote_block_ids[first:end]), remote_engine_id=params.remote_engine_id,
            remote_host=params.remote_host, remote_port=params.remote_port,
            remote_request_id=params.remote_request_id,
            remote_ports=list(params.remote_ports or (params.remote_port,)), first_block=first))
        self._loading_ids.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PullConnectorMetadata:
        metadata = PullConnectorMetadata(loads=self._loads, sends=self._sends,
                                         finished_request_ids=sorted(scheduler_output.finished_request_ids))
        self._loads, self._sends = [], []
        return metadata

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._loading_ids -= connector_output.finished_recving

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._handled_ids.discard(request.request_id)
        if request.request_id in self._loading_ids:
            # The worker may still be writing into its blocks: they are freed when the load is reported ended.
            return True, None
        if not self.config.is_producer:
            return False, None
        from pagedserve.core.request import RequestStatus  # core's enum; the module stays import-light

        request_params = self._params(request)
        if request_params is None or not request_params.do_remote_decode or request.status not in (
                RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
            return False, None
        self._sends.append(request.request_id)
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.config.engine_id,
            "remote_host": self.host,
            "remote_port": self.ports[0],
            "remote_block_ids": list(block_ids),
            "remote_request_id": request.request_id,
        }
        if len(self.ports) > 1:  # several worker ranks, each serving its own KV shard
            params["remote_ports"] = list(self.ports)
        return True, params
