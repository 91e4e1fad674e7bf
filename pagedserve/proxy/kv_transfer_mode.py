"""What the proxy asks of its instances in each KV transfer mode, and the kv_transfer_params it sends them.

pull (PullConnector mode "pull"): P first, with max_tokens 1 and {"do_remote_decode": true}; D then, with the
  kv_transfer_params P's answer returned (P's address and block ids); D pulls the blocks.
push (PullConnector mode "push"): D and P at the same time, under one request id (the X-Request-Id header of
  both calls, P's suffixed: `prefill_request_id`). D gets {"do_remote_prefill": true, remote_host /
  remote_port(s) / remote_engine_id: P's, as P's GET /kv_transfer_info says (a P with several DP ranks: the rank that
  id names, push_producer_rank), "remote_block_ids": [], "remote_request_id": the id P's engine runs the request
  under}; D reserves its blocks and sends P a push order naming that id; P sends each layer's pages as its forward
  writes them (docs/kv_transfer.md).
In both modes every prefill instance must be a producer and every decode instance a consumer in the proxy's mode;
`instance_error` says what is wrong otherwise (the proxy refuses to start, or the request, naming both modes).
"""
from __future__ import annotations

from typing import Any

from pagedserve.kv_transfer.kv_transfer_info import KVTransferInfo
from pagedserve.kv_transfer.push_producer_rank import push_producer_rank
from pagedserve.proxy.instance_pool import PREFILL
from pagedserve.server.request_ids import REQUEST_ID_HEADER

KV_TRANSFER_MODES = ("pull", "push")
# Fields of the client's body that P does not get: P samples one token that nobody reads (D samples the first
# token itself from the KV it got), so only what shapes the prompt matters there. A stop string could even end
# P's request in the front end, before its kv_transfer_params are made (docs/kv_transfer.md).
_FIELDS_NOT_FOR_PREFILL = ("stream", "stream_options", "max_completion_tokens", "min_tokens", "stop",
                           "stop_token_ids", "n", "best_of", "logprobs", "top_logprobs", "echo", "response_format",
                           "structured_outputs", "return_token_ids", "include_stop_str_in_output", "request_id")


def instance_error(instance_name: str, role: str, info: KVTransferInfo, mode: str) -> str | None:
    """Why an instance with this kv_transfer_info cannot serve `role` behind a proxy in `mode` (None: it can)."""
    wanted_roles = "'kv_producer' or 'kv_both'" if role == PREFILL else "'kv_consumer' or 'kv_both'"
    if info.kv_connector != "PullConnector" or not (info.is_producer if role == PREFILL else info.is_consumer):
        return (f"{instance_name} runs {info.describe()}; a {role} instance behind the proxy needs kv_connector "
                f"'PullConnector' with kv_role {wanted_roles} (--kv-transfer-config)")
    if info.mode != mode:
        return (f"{instance_name} runs kv_connector_extra_config.mode={info.mode!r}, but this proxy runs "
                f"--kv-transfer-mode {mode!r}: start the instance with kv_connector_extra_config.mode={mode!r}, or "
                f"the proxy with --kv-transfer-mode {info.mode!r}")
    return None


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """P's body: the client's, less what only decoding reads, with max_tokens 1 and do_remote_decode."""
    prefill = {key: value for key, value in body.items() if key not in _FIELDS_NOT_FOR_PREFILL}
    prefill.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    return prefill


def prefill_request_id(request_id: str) -> str:
    """The id P runs a request under: the proxy's, suffixed (an instance with kv_role kv_both may be P and D of one
    request; one engine runs one request per id, and P holds its blocks under it after its answer)."""
    return f"{request_id}-prefill"


def prefill_headers(headers: dict[str, str]) -> dict[str, str]:
    """P's headers: the client's forwarded ones with the request id made P's (`prefill_request_id`)."""
    return {**headers, REQUEST_ID_HEADER: prefill_request_id(headers[REQUEST_ID_HEADER])}


def push_kv_transfer_params(producer: KVTransferInfo, producer_request_id: str) -> dict[str, Any]:
    """D's kv_transfer_params in push mode: where P is, and the engine request id P runs the request under. A P with
    several DP ranks runs the request on the rank its id names (kv_transfer/push_producer_rank.py): that rank's
    engine id and ports."""
    engine_id, ports = producer.engine_id, list(producer.ports)
    if len(producer.data_parallel_ranks) > 1:
        rank = producer.data_parallel_ranks[push_producer_rank(producer_request_id,
                                                               len(producer.data_parallel_ranks))]
        engine_id, ports = rank["engine_id"], list(rank["ports"])
    params: dict[str, Any] = {"do_remote_prefill": True, "remote_engine_id": engine_id,
                              "remote_host": producer.host, "remote_port": ports[0],
                              "remote_block_ids": [], "remote_request_id": producer_request_id}
    if len(ports) > 1:
        params["remote_ports"] = ports
    return params


__all__ = ["KV_TRANSFER_MODES", "instance_error", "prefill_body", "prefill_headers", "prefill_request_id",
           "push_kv_transfer_params"]
