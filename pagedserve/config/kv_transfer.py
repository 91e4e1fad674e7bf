"""KVTransferConfig: the KV connector knobs (prefill/decode disaggregation, the KV pool), with vLLM's names.

`kv_transfer_config` is given to EngineConfig.create / LLM(...) as a dict (or JSON text: `--kv-transfer-config`):
    {"kv_connector": "PullConnector", "kv_role": "kv_producer", "kv_port": 5600, "engine_id": "prefill-0",
     "kv_connector_extra_config": {"transport": "zmq", "free_timeout_s": 120, "transfer_timeout_s": 30}}
    (transport "mooncake": the bytes over Mooncake's Transfer Engine, kv_transfer/mooncake_block_transport.py;
    mode "push": D reserves its blocks first and P sends each layer's KV as its forward writes it,
    kv_transfer/push_connector_worker.py)
    {"kv_connector": "MultiConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"connectors": [{...one connector's config...}, {...}]}}
    {"kv_connector": "PoolConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"backend": "redis", "url": "redis://127.0.0.1:6379/0"}}  (config/kv_pool.py)
With data_parallel_size > 1 every DP rank runs its own connector under `for_data_parallel_rank` (its own engine id and
ports, derived as vLLM does); every worker rank of an engine serves on `worker_kv_port` (kv_port plus its rank).
A producer (P) keeps the blocks of a request sent with kv_transfer_params {"do_remote_decode": true} after it
finishes and serves them; a consumer (D) pulls them for a request sent with the kv_transfer_params P returned
(pagedserve/kv_transfer/). A pool connector looks up, loads (consumer) and stores (producer) full blocks in a store
shared by engines.
"""
from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedserve.config.knob_dict import config_from_dict
from pagedserve.config.kv_pool import KVPoolConfig
from pagedserve.config.speculative import BLOCK_DRAFT_METHODS

KV_CONNECTORS = ("PullConnector", "PoolConnector", "MultiConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
PRODUCER_ROLES = ("kv_producer", "kv_both")  # roles whose engine serves its blocks to others
CONSUMER_ROLES = ("kv_consumer", "kv_both")  # roles whose engine loads blocks from others
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
TRANSPORTS = ("zmq", "mooncake")
# PullConnector modes: "pull" (D reads P's blocks after P's prefill) or "push" (D reserves its blocks and tells P
# where they are; P sends each layer's KV as soon as its forward wrote it, overlapping P's remaining layers).
KV_TRANSFER_MODES = ("pull", "push")
# Transports that can carry the push mode's layer stream (P sends on the consumer's control connection).
PUSH_TRANSPORTS = ("zmq",)
# Speculative methods whose drafter computes its KV at a prompt position from the target's hidden state there: with a
# connector the target computes only the positions past the KV it loaded, so the drafter's pages travel beside the
# target's (kv_transfer/connector_factory.py), and the producer must run the same speculative_config.
DRAFTER_KV_TRAVELS_METHODS = ("eagle", "eagle3", "mtp")
# Extra keys the pull connector reads, with their defaults.
PULL_CONNECTOR_DEFAULTS: dict[str, Any] = {
    "transport": "zmq",
    "mode": "pull",
    # Seconds a producer keeps a finished request's blocks when no consumer says it is done with them.
    "free_timeout_s": 120.0,
    # Seconds a consumer waits for a producer's answer before the load counts as failed.
    "transfer_timeout_s": 30.0,
    # The address consumers reach this producer at (it also binds there).
    "host": "127.0.0.1",
}


class KVRolePredicates:
    """is_producer / is_consumer of a `kv_role`: one definition for KVTransferConfig and for the kv_transfer_info a
    server reports of it (kv_transfer/kv_transfer_info.py, which the PD proxy parses from JSON and holds no config)."""

    kv_role: str | None  # a field of the dataclass that mixes this in

    @property
    def is_producer(self) -> bool:
        return self.kv_role in PRODUCER_ROLES

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in CONSUMER_ROLES


@dataclass(frozen=True)
class KVTransferConfig(KVRolePredicates):
    """One KV connector's settings (MultiConnector: its parts in kv_connector_extra_config.connectors)."""

    kv_connector: str | None = None
    kv_role: str | None = None
    # The producer's port for handshakes and block reads; 0 picks a free one (a consumer binds none).
    kv_port: int = 0
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector={self.kv_connector!r} must be one of "
                             f"{list(KV_CONNECTORS)}")
        if self.kv_role is None:
            raise ValueError(f"kv_transfer_config.kv_role is missing: give one of {list(KV_ROLES)}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role={self.kv_role!r} must be one of {list(KV_ROLES)}")
        if not isinstance(self.kv_port, int) or isinstance(self.kv_port, bool) or not 0 <= self.kv_port <= 65535:
            raise ValueError(f"kv_transfer_config.kv_port={self.kv_port!r} must be an integer in [0, 65535]")
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ValueError(f"kv_transfer_config.engine_id={self.engine_id!r} must be a non-empty string")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config={self.kv_connector_extra_config!r} "
                             f"must be a dict")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_transfer_config.kv_load_failure_policy={self.kv_load_failure_policy!r} must be "
                             f"one of {list(KV_LOAD_FAILURE_POLICIES)}")
        if self.kv_connector == "PullConnector":
            self._check_pull_extra_config()
        elif self.kv_connector == "PoolConnector":
            self.pool_config  # validates the pool's knobs
        else:
            self._check_multi_extra_config()

    def _check_pull_extra_config(self) -> None:
        extra = self.kv_connector_extra_config
        unknown = sorted(set(extra) - set(PULL_CONNECTOR_DEFAULTS))
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config has unknown keys {unknown} for "
                             f"PullConnector; allowed: {sorted(PULL_CONNECTOR_DEFAULTS)}")
        transport = extra.get("transport", "zmq")
        if transport not in TRANSPORTS:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.transport={transport!r} must be one "
                             f"of {list(TRANSPORTS)}")
        mode = extra.get("mode", "pull")
        if mode not in KV_TRANSFER_MODES:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.mode={mode!r} must be one of "
                             f"{list(KV_TRANSFER_MODES)}")
        if mode == "push" and transport not in PUSH_TRANSPORTS:
            # Mooncake's Transfer Engine reads whole requests cache to cache here; the layer stream rides zmq.
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.mode='push' cannot run over "
                             f"transport={transport!r}: push needs transport one of {list(PUSH_TRANSPORTS)} (or "
                             f"use mode 'pull' with {transport!r})")
        for name in ("free_timeout_s", "transfer_timeout_s"):
            value = extra.get(name, PULL_CONNECTOR_DEFAULTS[name])
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{name}={value!r} must be a "
                                 f"number > 0")
        host = extra.get("host", "127.0.0.1")
        if not isinstance(host, str) or not host:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.host={host!r} must be a host name")

    def _check_multi_extra_config(self) -> None:
        connectors = self.kv_connector_extra_config.get("connectors")
        if not isinstance(connectors, list) or len(connectors) < 1:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.connectors={connectors!r} must be a "
                             f"non-empty list of connector configs for MultiConnector")
        parts = self.connector_configs
        if any(part.kv_connector == "MultiConnector" for part in parts):
            raise ValueError("kv_transfer_config.kv_connector_extra_config.connectors may not hold a "
                             "MultiConnector")
        # A pool connector stores blocks rather than serving them: it does not count as a block server.
        if sum(part.is_producer and part.kv_connector == "PullConnector" for part in parts) > 1:
            raise ValueError("kv_transfer_config.kv_connector_extra_config.connectors holds more than one "
                             "producer; one engine serves its blocks through one connector")

    @property
    def connector_configs(self) -> list["KVTransferConfig"]:
        """MultiConnector's parts, in order (a part without its own kv_role takes this one's)."""
        parts = []
        for index, value in enumerate(self.kv_connector_extra_config.get("connectors", [])):
            if not isinstance(value, dict):
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config.connectors[{index}]={value!r} "
                                 f"must be a dict")
            value = {"kv_role": self.kv_role, "engine_id": f"{self.engine_id}-{index}",
                     "kv_load_failure_policy": self.kv_load_failure_policy} | value
            parts.append(config_from_dict(KVTransferConfig,
                                          f"kv_transfer_config.kv_connector_extra_config.connectors[{index}]",
                                          value))
        return parts

    @property
    def pool_config(self) -> KVPoolConfig:
        """A PoolConnector's knobs (validated)."""
        if self.kv_connector != "PoolConnector":
            raise ValueError(f"kv_transfer_config.kv_connector={self.kv_connector!r} has no pool knobs")
        return KVPoolConfig.from_extra_config(self.kv_connector_extra_config)

    def for_data_parallel_rank(self, data_parallel_rank: int, world_size_per_engine: int) -> "KVTransferConfig":
        """This config as DP rank `data_parallel_rank` of an engine with data_parallel_size > 1 runs it (each DP rank
        is its own engine with its own connector), derived as vLLM derives its DP ranks' connectors:
        - engine_id `<engine_id>_dp<rank>` (vLLM's spelling), so P's kv_transfer_params name the rank holding the
          blocks;
        - kv_port offset by `rank * world_size_per_engine` when set (the rank's worker ranks then add their own rank,
          `worker_kv_port`): DP rank r's worker rank w serves on kv_port + r * world_size_per_engine + w. kv_port 0
          stays 0 (every worker picks a free port).
        A MultiConnector's parts are derived the same way (a part without its own engine_id takes the derived
        `<engine_id>_dp<rank>-<index>`)."""
        if data_parallel_rank < 0 or world_size_per_engine < 1:
            raise ValueError(f"data_parallel_rank={data_parallel_rank} must be >= 0 and world_size_per_engine="
                             f"{world_size_per_engine} >= 1")
        offset = data_parallel_rank * world_size_per_engine
        extra = self.kv_connector_extra_config
        if self.kv_connector == "MultiConnector":
            parts = []
            for value in extra.get("connectors", []):
                part = dict(value)
                if "engine_id" in part:
                    part["engine_id"] = f"{part['engine_id']}_dp{data_parallel_rank}"
                if part.get("kv_port"):
                    part["kv_port"] = part["kv_port"] + offset
                parts.append(part)
            extra = extra | {"connectors": parts}
        return dataclasses.replace(self, engine_id=f"{self.engine_id}_dp{data_parallel_rank}",
                                   kv_port=self.kv_port + offset if self.kv_port else 0,
                                   kv_connector_extra_config=extra)

    def worker_kv_port(self, worker_rank: int) -> int:
        """The block-server port of worker rank `worker_rank` (pp_rank * tensor_parallel_size + tp_rank) of this
        engine: kv_port + worker_rank, or 0 (a free port) when kv_port is 0."""
        return self.kv_port + worker_rank if self.kv_port else 0

    def extra(self, name: str) -> Any:
        """A pull connector extra knob, or its default."""
        return self.kv_connector_extra_config.get(name, PULL_CONNECTOR_DEFAULTS[name])

    def check_engine(self, parallel_config: Any, speculative_method: str | None,
                     sparse_kv_offload: bool = False) -> None:
        """Refuse, at start, the engine options the KV connector does not serve yet (naming both).

        Served: async scheduling (a request waiting for remote KV holds its blocks outside the steps in flight; a
        finished request's held blocks are freed only after the worker, which runs the steps in order, reports
        it); speculation whose drafter needs only the prompt's tokens ('ngram', 'draft_model': the draft model
        recomputes its own KV over the whole prompt at its first draft, so only the target's pages travel), and the
        hidden-state drafters of DRAFTER_KV_TRAVELS_METHODS (their pages travel too) with PullConnector."""
        # Tensor and pipeline parallel ranks each move their own KV shard (kv_transfer/kv_pull_plan.py); data
        # parallel ranks are engines of their own, each with its own connector (for_data_parallel_rank).
        context_degrees = (parallel_config.decode_context_parallel_size, parallel_config.prefill_context_parallel_size)
        if context_degrees != (1, 1):
            raise ValueError(f"kv_transfer_config.kv_connector={self.kv_connector!r} is not supported with context "
                             f"parallelism yet: decode_context_parallel_size and prefill_context_parallel_size must "
                             f"be 1 (got {context_degrees})")
        parts = self.connector_configs if self.kv_connector == "MultiConnector" else [self]
        ranks = (parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size)
        if any(part.kv_connector == "PoolConnector" for part in parts) and (
                ranks != (1, 1) or parallel_config.executor_backend != "uni"):
            # A pool block holds every layer's whole page under one key: ranks would store their shards over it.
            raise ValueError(f"kv_transfer_config.kv_connector='PoolConnector' runs in the engine's own process "
                             f"for now: tensor_parallel_size and pipeline_parallel_size must be 1 (got {ranks}) and "
                             f"distributed_executor_backend None or 'uni' (got "
                             f"{parallel_config.distributed_executor_backend!r})")
        if parallel_config.data_parallel_size > 1:
            self._check_data_parallel(parts, parallel_config.data_parallel_size)
        num_serving_ranks = parallel_config.data_parallel_size * parallel_config.world_size_per_engine
        for part in parts:
            # Worker rank w of DP rank r serves on kv_port + r * world_size_per_engine + w (for_data_parallel_rank).
            last = part.kv_port + num_serving_ranks - 1
            if part.kv_port and part.is_producer and last > 65535:
                raise ValueError(f"kv_transfer_config.kv_port={part.kv_port}: data_parallel_size="
                                 f"{parallel_config.data_parallel_size} x {parallel_config.world_size_per_engine} "
                                 f"worker rank(s) each serve on kv_port + their rank, up to {last} > 65535; choose "
                                 f"kv_port <= {65536 - num_serving_ranks} or 0 (free ports)")
        if parallel_config.executor_backend == "ray":
            # Every rank advertises one host (kv_connector_extra_config.host): ranks on other nodes are unreachable.
            raise ValueError(f"kv_transfer_config.kv_connector={self.kv_connector!r} is not supported with "
                             f"distributed_executor_backend='ray' yet: use 'mp' (or 'uni' with one worker)")
        if speculative_method in BLOCK_DRAFT_METHODS:
            # Their drafter's context KV also comes from the target's layers at every prompt position; it is not
            # registered with the connector (only DRAFTER_KV_TRAVELS_METHODS' is), so D would draft without it.
            raise ValueError(f"kv_transfer_config.kv_connector={self.kv_connector!r} is not supported with "
                             f"speculative_config.method={speculative_method!r} (its drafter's context KV over the "
                             f"prompt comes from the target's layers and does not travel): use method 'ngram', "
                             f"'draft_model', 'eagle', 'eagle3' or 'mtp', or drop one of them")
        if speculative_method in DRAFTER_KV_TRAVELS_METHODS and any(
                part.kv_connector == "PoolConnector" for part in parts):
            # Pool blocks are named by the target's tokens and signature: a drafter's pages would be shared by
            # engines whose drafters differ.
            raise ValueError(f"kv_transfer_config.kv_connector='PoolConnector' is not supported with "
                             f"speculative_config.method={speculative_method!r} (the drafter's KV over a prefix would "
                             f"have to be pooled too, under keys that do not name the drafter): use method 'ngram' or "
                             f"'draft_model' with the pool, or drop one of them")
        if any(part.kv_connector == "PullConnector" and part.extra("mode") == "push" for part in parts):
            # Push is tested with one worker rank a side and the target's pages only; the kv pp / unequal TP plan
            # and drafter pages are pull-mode features until a test covers them in push mode.
            if ranks != (1, 1):
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config.mode='push' runs with "
                                 f"tensor_parallel_size and pipeline_parallel_size 1 for now (got {ranks}): use "
                                 f"mode 'pull' for kv pp and unequal TP")
            if speculative_method in DRAFTER_KV_TRAVELS_METHODS:
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config.mode='push' is not supported with "
                                 f"speculative_config.method={speculative_method!r} (its drafter's pages travel in "
                                 f"mode 'pull' only): use mode 'pull', or drop one of them")
        if sparse_kv_offload:
            # The offloaded latents live in the tier file, not in the KV pages the connector moves.
            raise ValueError(f"kv_transfer_config.kv_connector={self.kv_connector!r} is not supported with "
                             f"sparse_kv_offload: drop one of them")

    @staticmethod
    def _check_data_parallel(parts: list["KVTransferConfig"], data_parallel_size: int) -> None:
        """data_parallel_size > 1 runs the PullConnector (both modes; a push-mode producer routes each request to the
        DP rank its id names, kv_transfer/push_producer_rank.py), not the pool connector."""
        for part in parts:
            if part.kv_connector == "PoolConnector":
                # Untested per DP rank (one store connection and one put queue per rank).
                raise ValueError(f"kv_transfer_config.kv_connector='PoolConnector' is not supported with "
                                 f"data_parallel_size={data_parallel_size} yet: use data_parallel_size 1 with the "
                                 f"pool (PullConnector runs with data parallelism)")

    @staticmethod
    def parse(value: "KVTransferConfig | dict[str, Any] | str | None") -> "KVTransferConfig | None":
        """None (no connector), or the validated config from a dict or its JSON text."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        return config_from_dict(KVTransferConfig, "kv_transfer_config", value)


__all__ = ["KVRolePredicates", "KVTransferConfig", "KV_CONNECTORS", "KV_TRANSFER_MODES", "PUSH_TRANSPORTS", "KV_ROLES",
           "PRODUCER_ROLES", "CONSUMER_ROLES", "KV_LOAD_FAILURE_POLICIES", "DRAFTER_KV_TRAVELS_METHODS"]
