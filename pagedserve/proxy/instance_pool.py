"""The proxy's upstream instances (prefill or decode servers) and the least-loaded choice among them.

An instance is `up` until a request to it fails to connect (or its /health stops answering 200); the health
probe brings it back. Least-loaded = fewest requests in flight; ties go to the instance that has served the
fewest requests so far, then to the first listed, so an idle pool is used round robin.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.kv_transfer.kv_transfer_info import KVTransferInfo

PREFILL = "prefill"
DECODE = "decode"


@dataclass
class Instance:
    """One upstream OpenAI server and its counters (what /metrics shows per instance)."""

    url: str
    role: str
    is_up: bool = True
    num_in_flight: int = 0
    num_requests: int = 0
    num_failures: int = 0
    # The last connection or health error, for /health and the logs.
    last_error: str = ""
    # Its /kv_transfer_info once read and found fit for the proxy's mode (None: read it before use; cleared when
    # the instance comes back up, since a restart may move its block server).
    kv_transfer_info: KVTransferInfo | None = None

    @property
    def name(self) -> str:
        return f"{self.role} instance {self.url}"


class NoInstanceError(Exception):
    """Every instance of a role is down."""


class InstancePool:
    """The instances of one role (prefill or decode)."""

    def __init__(self, role: str, urls: list[str]) -> None:
        self.role = role
        self.instances = [Instance(url.rstrip("/"), role) for url in urls]

    def __len__(self) -> int:
        return len(self.instances)

    def pick(self) -> Instance:
        """The live instance with the fewest requests in flight (NoInstanceError when none is up)."""
        live = [(instance.num_in_flight, instance.num_requests, index)
                for index, instance in enumerate(self.instances) if instance.is_up]
        if not live:
            errors = "; ".join(f"{instance.url}: {instance.last_error or 'down'}" for instance in self.instances)
            raise NoInstanceError(f"no {self.role} instance is up ({errors})")
        return self.instances[min(live)[2]]

    def has_live_instance(self) -> bool:
        return any(instance.is_up for instance in self.instances)
