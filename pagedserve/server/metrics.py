"""Prometheus metrics with vLLM's metric names, served at GET /metrics.

Gauges and cumulative counters come from the engine's SchedulerStats (sent with every step's
outputs); latencies and token counts are measured in the server process as outputs arrive. Each
server has its own CollectorRegistry, so two servers in one process never share counters.

Counters are exposed with Prometheus' `_total` suffix (vllm:prompt_tokens_total, ...) exactly as
vLLM's are; every metric carries a `model_name` label.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagedserve.core.engine_core_output import SchedulerStats
from pagedserve.engine.metrics_reader import SPARSE_KV_OFFLOAD_COUNTERS, SPARSE_KV_OFFLOAD_GAUGES

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    """The server's metrics; implements AsyncLLM's StatLogger protocol."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        registry = self.registry

        def gauge(name: str, documentation: str) -> Gauge:
            return Gauge(name, documentation, labels, registry=registry).labels(model_name)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, labels, registry=registry).labels(model_name)

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, documentation, labels, buckets=buckets, registry=registry).labels(model_name)

        self.num_requests_running = gauge("vllm:num_requests_running", "Requests in the engine's running batch.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent used.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.external_prefix_cache_queries = counter(
            "vllm:external_prefix_cache_queries", "Tokens of the requests looked up in the KV connector (a KV pool).")
        self.external_prefix_cache_hits = counter("vllm:external_prefix_cache_hits",
                                                  "Tokens the KV connector (a KV pool) provided.")
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens processed.")
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Time to first token in seconds.", _TTFT_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Time between successive output updates in seconds.", _ITL_BUCKETS)
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds",
                                             "End-to-end request latency in seconds.", _E2E_BUCKETS)
        success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                          ["model_name", "finished_reason"], registry=registry)
        self.request_success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self._success_family = success
        self._model_name = model_name
        # EPLB: per MoE layer, max/mean tokens per rank before and after the latest rebalance.
        self.eplb_num_rebalances = gauge("pagedserve:eplb_num_rebalances", "EPLB rebalances so far.")
        self._eplb_imbalance = Gauge("pagedserve:eplb_imbalance",
                                     "EPLB per-layer load imbalance (max/mean tokens per rank) before and after "
                                     "the latest rebalance.", ["model_name", "layer", "phase"], registry=registry)
        # Speculative decoding, with vLLM's names.
        self.spec_decode_num_drafts = counter("vllm:spec_decode_num_drafts", "Verification steps with drafts.")
        self.spec_decode_num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_decode_num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens",
                                                       "Draft tokens accepted.")
        self._accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted, by draft position.", ["model_name", "position"],
                                         registry=registry)
        # Sparse KV offload (engine/metrics_reader.py names them); only advanced while offload is on.
        self._sparse_kv_offload_counters = {
            field: counter(name, f"Sparse KV offload: cumulative {field.removeprefix('num_').replace('_', ' ')}.")
            for field, name in SPARSE_KV_OFFLOAD_COUNTERS.items()}
        self._sparse_kv_offload_gauges = {
            field: gauge(name, f"Sparse KV offload: {field.removeprefix('num_').replace('_', ' ')} now.")
            for field, name in SPARSE_KV_OFFLOAD_GAUGES.items()}
        # Last cumulative values seen from the engine (counters advance by the difference).
        self._last_stats = SchedulerStats()

    # StatLogger ------------------------------------------------------------------------------
    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running_requests)
        self.num_requests_waiting.set(stats.num_waiting_requests)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        if stats.eplb_num_rebalances:
            self.eplb_num_rebalances.set(stats.eplb_num_rebalances)
            for phase, values in (("before", stats.eplb_imbalance_before), ("after", stats.eplb_imbalance_after)):
                for layer, value in enumerate(values):
                    self._eplb_imbalance.labels(self._model_name, str(layer), phase).set(value)
        last = self._last_stats
        for counter, now, before in (
                (self.prefix_cache_queries, stats.prefix_cache_queries, last.prefix_cache_queries),
                (self.prefix_cache_hits, stats.prefix_cache_hits, last.prefix_cache_hits),
                (self.external_prefix_cache_queries, stats.external_prefix_cache_queries,
                 last.external_prefix_cache_queries),
                (self.external_prefix_cache_hits, stats.external_prefix_cache_hits, last.external_prefix_cache_hits),
                (self.num_preemptions, stats.num_preemptions, last.num_preemptions),
                (self.spec_decode_num_drafts, stats.spec_decode_num_drafts, last.spec_decode_num_drafts),
                (self.spec_decode_num_draft_tokens, stats.spec_decode_num_draft_tokens,
                 last.spec_decode_num_draft_tokens),
                (self.spec_decode_num_accepted_tokens, stats.spec_decode_num_accepted_tokens,
                 last.spec_decode_num_accepted_tokens)):
            if now > before:
                counter.inc(now - before)
        before_per_pos = last.spec_decode_num_accepted_tokens_per_pos
        for position, now in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            before = before_per_pos[position] if position < len(before_per_pos) else 0
            if now > before:
                self._accepted_per_pos.labels(self._model_name, str(position)).inc(now - before)
        offload, last_offload = stats.sparse_kv_offload, last.sparse_kv_offload
        if offload is not None:
            for field, offload_counter in self._sparse_kv_offload_counters.items():
                now, before = getattr(offload, field), getattr(last_offload, field) if last_offload else 0
                if now > before:
                    offload_counter.inc(now - before)
            for field, offload_gauge in self._sparse_kv_offload_gauges.items():
                offload_gauge.set(getattr(offload, field))
        self._last_stats = stats

    def record_first_token(self, time_to_first_token: float) -> None:
        self.time_to_first_token.observe(time_to_first_token)

    def record_inter_token(self, inter_token_latency: float) -> None:
        self.inter_token_latency.observe(inter_token_latency)

    def record_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generation_tokens)

    def record_finished(self, finish_reason: str, e2e_latency: float) -> None:
        counter = self.request_success.get(finish_reason)
        if counter is None:
            counter = self.request_success[finish_reason] = self._success_family.labels(self._model_name,
                                                                                        finish_reason)
        counter.inc()
        self.e2e_request_latency.observe(e2e_latency)

    def render(self) -> bytes:
        return generate_latest(self.registry)
