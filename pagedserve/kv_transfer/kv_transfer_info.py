"""What a server tells a PD proxy about its prefill/decode KV connector (GET /kv_transfer_info).

{"kv_connector": "PullConnector" | null, "kv_role": ..., "mode": "pull" | "push", "engine_id": ..., "host": ...,
 "ports": [every worker rank's block-server port], "data_parallel_ranks": [{"engine_id", "ports"} per DP rank]}: the
PullConnector's settings (a MultiConnector's PullConnector part), and where a producer serves its blocks (with
data_parallel_size > 1 each DP rank serves its own; "engine_id" and "ports" are DP rank 0's). The push-mode proxy
learns a producer's address from it once, then names it (the request's DP rank's) in the kv_transfer_params it sends
the consumer with each request (remote_host, remote_port(s), remote_engine_id), so P and D get the request at the
same time; both proxies check every instance's role and mode
with it at start. The engine id and ports come from the engine process (its own engine_id when none was configured,
its bound ports when kv_port is 0). Pure Python.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pagedserve.config.kv_transfer import KVRolePredicates, KVTransferConfig


def pd_connector_config(config: KVTransferConfig | None) -> KVTransferConfig | None:
    """The PullConnector of a kv_transfer_config (itself, or its MultiConnector part); None when there is none."""
    if config is None:
        return None
    if config.kv_connector == "PullConnector":
        return config
    if config.kv_connector == "MultiConnector":
        return next((part for part in config.connector_configs if part.kv_connector == "PullConnector"), None)
    return None


@dataclass(frozen=True)
class KVTransferInfo(KVRolePredicates):
    """A server's prefill/decode connector, as GET /kv_transfer_info answers it (see the module docstring); its
    is_producer / is_consumer are the config's (KVRolePredicates)."""

    kv_connector: str | None = None
    kv_role: str | None = None
    mode: str | None = None
    engine_id: str = ""
    host: str = ""
    ports: list[int] = field(default_factory=list)
    # Every data parallel rank's connector, in DP rank order: [{"engine_id": ..., "ports": [...]}] (one entry with
    # data_parallel_size 1). Each DP rank is its own P or D engine (config/kv_transfer.py for_data_parallel_rank);
    # engine_id and ports above are DP rank 0's. A producer rank names itself in the kv_transfer_params it returns.
    data_parallel_ranks: list[dict[str, Any]] = field(default_factory=list)

    @staticmethod
    def from_engine(config: KVTransferConfig | None, engine_id: str, ports: list[int],
                    data_parallel_ranks: list[dict[str, Any]] | None = None) -> "KVTransferInfo":
        """From the engine's kv_transfer_config and what the engine process reported (its PD connector's
        engine id and block servers' ports: DP rank 0's, and `data_parallel_ranks`, every DP rank's)."""
        part = pd_connector_config(config)
        if part is None:
            return KVTransferInfo()
        engine_id = engine_id or part.engine_id
        ranks = [{"engine_id": str(rank["engine_id"]),
                  "ports": [int(port) for port in rank["ports"]] if part.is_producer else []}
                 for rank in data_parallel_ranks or [{"engine_id": engine_id, "ports": ports}]]
        return KVTransferInfo(kv_connector=part.kv_connector, kv_role=part.kv_role, mode=part.extra("mode"),
                              engine_id=engine_id, host=part.extra("host") if part.is_producer else "",
                              ports=list(ports) if part.is_producer else [], data_parallel_ranks=ranks)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(value: Any) -> "KVTransferInfo":
        """Parse an answer (ValueError naming the field when it has another shape)."""
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_info={value!r} must be a JSON object")
        info = KVTransferInfo(**{name: value[name] for name in KVTransferInfo.__dataclass_fields__ if name in value})
        if info.kv_connector is not None and info.is_producer and (
                not isinstance(info.host, str) or not info.host or not isinstance(info.ports, list) or not info.ports
                or not all(isinstance(port, int) and 1 <= port <= 65535 for port in info.ports)):
            raise ValueError(f"kv_transfer_info of a producer needs a host and ports in [1, 65535], got "
                             f"host={info.host!r} ports={info.ports!r}")
        if not isinstance(info.data_parallel_ranks, list) or not all(
                isinstance(rank, dict) and isinstance(rank.get("engine_id"), str)
                and isinstance(rank.get("ports"), list) for rank in info.data_parallel_ranks):
            raise ValueError(f"kv_transfer_info.data_parallel_ranks={info.data_parallel_ranks!r} must be a list of "
                             f"{{'engine_id': str, 'ports': [int]}}")
        return info

    def describe(self) -> str:
        """`kv_connector=..., kv_role=..., mode=...` for error messages."""
        if self.kv_connector is None:
            return "no kv_transfer_config"
        return f"kv_connector={self.kv_connector!r}, kv_role={self.kv_role!r}, mode={self.mode!r}"


__all__ = ["KVTransferInfo", "pd_connector_config"]
