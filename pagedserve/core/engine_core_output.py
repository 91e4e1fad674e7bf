"""What the engine core reports per request per step (produced by Scheduler.update_from_output)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.core.scheduler_output import LogprobsLists
from pagedserve.core.sparse_kv_offload_stats import SparseKVOffloadStats


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort' | 'error'
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # A producer's finished request: how a consumer fetches its KV (kv_transfer/kv_transfer_params.py).
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    """Counters and gauges the scheduler exposes (cumulative counters grow monotonically)."""

    num_running_requests: int = 0
    num_waiting_requests: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable blocks in use
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int = 0  # tokens found (cumulative)
    # The KV connector's prefix lookups (a KV pool; cumulative, vLLM's external_prefix_cache counters): tokens of the
    # requests looked up, tokens found.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    num_preemptions: int = 0  # cumulative
    # EPLB (MoE expert load balancing): rebalances so far, and per MoE layer the max/mean tokens per rank
    # over the window before and after the latest one (empty lists before the first rebalance).
    eplb_num_rebalances: int = 0
    eplb_imbalance_before: list[float] = field(default_factory=list)
    eplb_imbalance_after: list[float] = field(default_factory=list)
    # Speculative decoding (cumulative, vLLM's spec_decode counters): verification steps with drafts, drafts
    # verified, drafts accepted, and drafts accepted at each draft position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # Sparse KV offload (pagedserve/sparse_kv_offload/): the worker's counters after its latest step; None when
    # offload is off.
    sparse_kv_offload: SparseKVOffloadStats | None = None
