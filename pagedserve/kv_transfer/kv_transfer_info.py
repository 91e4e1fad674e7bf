"""What a server tells a PD proxy about its prefill/decode KV connector (GET /kv_transfer_info).

{"kv_connector": "PullConnector" | null, "kv_role": ..., "mode": "pull" | "push", "engine_id": ..., "host": ...,
 "ports": [every worker rank's block-server port]}: the PullConnector's settings (a MultiConnector's PullConnector
part), and where a producer serves its blocks. The push-mode proxy learns a producer's address from it once, then
names it in the kv_transfer_params it sends the consumer with each request (remote_host, remote_port(s),
remote_engine_id), so P and D get the request at the same time; both proxies check every instance's role and mode
with it at start. The engine id and ports come from the engine process (its own engine_id when none was configured,
its bound ports when kv_port is 0). Pure Python.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pagedserve.config.kv_transfer import KVTransferConfig


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
class KVTransferInfo:
    """A server's prefill/decode connector, as GET /kv_transfer_info answers it (see the module docstring)."""

    kv_connector: str | None = None
    kv_role: str | None = None
    mode: str | None = None
    engine_id: str = ""
    host: str = ""
    ports: list[int] = field(default_factory=list)

    @staticmethod
    def from_engine(config: KVTransferConfig | None, engine_id: str, ports: list[int]) -> "KVTransferInfo":
        """From the engine's kv_transfer_config and what the engine process reported (its PD connector's
        engine id, its block servers' ports)."""
        part = pd_connector_config(config)
        if part is None:
            return KVTransferInfo()
        return KVTransferInfo(kv_connector=part.kv_connector, kv_role=part.kv_role, mode=part.extra("mode"),
                              engine_id=engine_id or part.engine_id,
                              host=part.extra("host") if part.is_producer else "",
                              ports=list(ports) if part.is_producer else [])

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

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
        return info

    def describe(self) -> str:
        """`kv_connector=..., kv_role=..., mode=...` for error messages."""
        if self.kv_connector is None:
            return "no kv_transfer_config"
        return f"kv_connector={self.kv_connector!r}, kv_role={self.kv_role!r}, mode={self.mode!r}"


__all__ = ["KVTransferInfo", "pd_connector_config"]
