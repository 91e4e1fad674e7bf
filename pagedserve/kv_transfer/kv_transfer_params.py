"""kv_transfer_params: what a request tells the KV connector (vLLM's keys), and what a producer hands back.

Given per request in `SamplingParams.extra_args["kv_transfer_params"]`:
- to a producer (P): {"do_remote_decode": true} (with max_tokens=1): keep the prompt's blocks after the request
  finishes and return, in `RequestOutput.kv_transfer_params`, how to fetch them;
- to a consumer (D): what P returned: {"do_remote_prefill": true, "remote_engine_id", "remote_host",
  "remote_port", "remote_block_ids", "remote_request_id"} (and "remote_ports", every producer rank's port, when P
  has several worker ranks): pull those blocks instead of computing the prompt.
Pure Python (the scheduler reads it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_REMOTE_PREFILL_KEYS = ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids", "remote_request_id")
# Optional: every producer rank's port (a producer with several worker ranks); absent: [remote_port].
_KNOWN_KEYS = ("do_remote_decode", "do_remote_prefill", *_REMOTE_PREFILL_KEYS, "remote_ports")


@dataclass(frozen=True)
class KVTransferParams:
    """A request's parsed kv_transfer_params (see the module docstring)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str = ""
    remote_host: str = ""
    remote_port: int = 0
    remote_block_ids: tuple[int, ...] = ()
    remote_request_id: str = ""
    remote_ports: tuple[int, ...] = ()

    @staticmethod
    def parse(value: Any, max_tokens: int | None) -> "KVTransferParams":
        """Validate a request's kv_transfer_params dict (ValueError naming the key, the value and what is allowed)."""
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_params={value!r} must be a dict")
        unknown = sorted(set(value) - set(_KNOWN_KEYS))
        if unknown:
            raise ValueError(f"kv_transfer_params has unknown keys {unknown}; allowed: {list(_KNOWN_KEYS)}")
        do_remote_decode = value.get("do_remote_decode", False)
        do_remote_prefill = value.get("do_remote_prefill", False)
        for name, flag in (("do_remote_decode", do_remote_decode), ("do_remote_prefill", do_remote_prefill)):
            if not isinstance(flag, bool):
                raise ValueError(f"kv_transfer_params.{name}={flag!r} must be true or false")
        if do_remote_decode and do_remote_prefill:
            raise ValueError("kv_transfer_params sets both do_remote_decode and do_remote_prefill; a request is "
                             "either prefilled for a remote decode (producer) or decoded after a remote prefill "
                             "(consumer)")
        if do_remote_decode and max_tokens != 1:
            raise ValueError(f"kv_transfer_params.do_remote_decode=true needs max_tokens=1 (got max_tokens="
                             f"{max_tokens}): the producer computes the prompt, the consumer decodes")
        if not do_remote_prefill:
            return KVTransferParams(do_remote_decode=do_remote_decode)
        missing = [key for key in _REMOTE_PREFILL_KEYS if key not in value]
        if missing:
            raise ValueError(f"kv_transfer_params.do_remote_prefill=true needs {missing} (the kv_transfer_params "
                             f"the producer returned)")
        port, block_ids = value["remote_port"], value["remote_block_ids"]
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise ValueError(f"kv_transfer_params.remote_port={port!r} must be an integer in [1, 65535]")
        if not isinstance(block_ids, (list, tuple)) or not all(
                isinstance(block_id, int) and not isinstance(block_id, bool) and block_id >= 0
                for block_id in block_ids):
            raise ValueError(f"kv_transfer_params.remote_block_ids={block_ids!r} must be a list of integers >= 0")
        ports = value.get("remote_ports", [port])
        if not isinstance(ports, (list, tuple)) or not ports or not all(
                isinstance(item, int) and not isinstance(item, bool) and 1 <= item <= 65535 for item in ports) \
                or ports[0] != port:
            raise ValueError(f"kv_transfer_params.remote_ports={ports!r} must be a non-empty list of ports in "
                             f"[1, 65535] starting with remote_port={port!r}")
        for key in ("remote_engine_id", "remote_host", "remote_request_id"):
            if not isinstance(value[key], str) or not value[key]:
                raise ValueError(f"kv_transfer_params.{key}={value[key]!r} must be a non-empty string")
        return KVTransferParams(do_remote_prefill=True, remote_engine_id=value["remote_engine_id"],
                                remote_host=value["remote_host"], remote_port=port,
                                remote_block_ids=tuple(block_ids), remote_request_id=value["remote_request_id"],
                                remote_ports=tuple(ports))


def request_kv_transfer_params(extra_args: dict[str, Any] | None) -> Any:
    """The raw kv_transfer_params of a request's SamplingParams.extra_args (None when absent)."""
    return None if extra_args is None else extra_args.get("kv_transfer_params")


def check_kv_transfer_params_accepted(extra_args: dict[str, Any] | None, has_connector: bool) -> None:
    """ValueError when a request carries kv_transfer_params to an engine without a KV connector."""
    if not has_connector and request_kv_transfer_params(extra_args) is not None:
        raise ValueError("the request has kv_transfer_params but the engine has no KV connector: start it with "
                         "kv_transfer_config")
