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
    return [
        Gauge("vllm:num_requests_running", dict(labels), float(stats.num_running_requests)),
        Gauge("vllm:num_requests_waiting", dict(labels), float(stats.num_waiting_requests)),
        Gauge("vllm:kv_cache_usage_perc", dict(labels), stats.kv_cache_usage),
        Counter("vllm:prefix_cache_queries", dict(labels), stats.prefix_cache_queries),
        Counter("vllm:prefix_cache_hits", dict(labels), stats.prefix_cache_hits),
        Counter("vllm:num_preemptions", dict(labels), stats.num_preemptions),
        Counter("vllm:spec_decode_num_drafts", dict(labels), stats.spec_decode_num_drafts),
        Counter("vllm:spec_decode_num_draft_tokens", dict(labels), stats.spec_decode_num_draft_tokens),
        Counter("vllm:spec_decode_num_accepted_tokens", dict(labels), stats.spec_decode_num_accepted_tokens),
        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels),
               list(stats.spec_decode_num_accepted_tokens_per_pos)),
    ]
