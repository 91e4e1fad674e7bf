"""The engine's metrics as plain objects, as vLLM's `LLM.get_metrics()` returns them (vllm.v1.metrics.reader):
Counter (cumulative int), Gauge (float) and Vector (one int per position) with vLLM's metric names and a
`model_name` label. The server exports the same values to Prometheus (server/metrics.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.core.engine_core_output import SchedulerStats


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    values: list[int] = field(default_factory=list)


def scheduler_stats_to_metrics(stats: SchedulerStats, model_name: str) -> list[Metric]:
    """The scheduler's gauges and cumulative counters under their vLLM names."""
    labels = {"model_name": model_name}
    return _scheduler_metrics(stats, labels) + sparse_kv_offload_metrics(stats, labels)


def _scheduler_metrics(stats: SchedulerStats, labels: dict[str, str]) -> list[Metric]:
    return [
        Gauge("vllm:num_requests_running", dict(labels), float(stats.num_running_requests)),
        Gauge("vllm:num_requests_waiting", dict(labels), float(stats.num_waiting_requests)),
        Gauge("vllm:kv_cache_usage_perc", dict(labels), stats.kv_cache_usage),
        Counter("vllm:prefix_cache_queries", dict(labels), stats.prefix_cache_queries),
        Counter("vllm:prefix_cache_hits", dict(labels), stats.prefix_cache_hits),
        Counter("vllm:external_prefix_cache_queries", dict(labels), stats.external_prefix_cache_queries),
        Counter("vllm:external_prefix_cache_hits", dict(labels), stats.external_prefix_cache_hits),
        Counter("vllm:num_preemptions", dict(labels), stats.num_preemptions),
        Counter("vllm:spec_decode_num_drafts", dict(labels), stats.spec_decode_num_drafts),
        Counter("vllm:spec_decode_num_draft_tokens", dict(labels), stats.spec_decode_num_draft_tokens),
        Counter("vllm:spec_decode_num_accepted_tokens", dict(labels), stats.spec_decode_num_accepted_tokens),
        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels),
               list(stats.spec_decode_num_accepted_tokens_per_pos)),
    ]


# Sparse KV offload's counters and gauges (SparseKVOffloadStats field -> metric name); none while offload is off.
SPARSE_KV_OFFLOAD_COUNTERS = {
    "num_block_hits": "pagedserve:sparse_kv_offload_block_hits",
    "num_block_misses": "pagedserve:sparse_kv_offload_block_misses",
    "num_blocks_moved_in": "pagedserve:sparse_kv_offload_blocks_moved_in",
    "num_blocks_evicted": "pagedserve:sparse_kv_offload_blocks_evicted",
    "num_tokens_moved_out": "pagedserve:sparse_kv_offload_tokens_moved_out",
    "num_multi_round_gathers": "pagedserve:sparse_kv_offload_multi_round_gathers",
}
SPARSE_KV_OFFLOAD_GAUGES = {
    "num_resident_blocks": "pagedserve:sparse_kv_offload_resident_blocks",
    "num_resident_buffers": "pagedserve:sparse_kv_offload_resident_buffers",
}


def sparse_kv_offload_metrics(stats: SchedulerStats, labels: dict[str, str]) -> list[Metric]:
    offload = stats.sparse_kv_offload
    if offload is None:
        return []
    return [Counter(name, dict(labels), getattr(offload, stat)) for stat, name in SPARSE_KV_OFFLOAD_COUNTERS.items()] \
        + [Gauge(name, dict(labels), float(getattr(offload, stat))) for stat, name in SPARSE_KV_OFFLOAD_GAUGES.items()]
