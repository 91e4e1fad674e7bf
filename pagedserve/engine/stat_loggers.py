"""Stat loggers beside the Prometheus metrics: vLLM's periodic engine log line, and a fan-out to several loggers.

The log line (INFO, every `interval_s` seconds while the engine reports) carries the throughput since the last
line, the running and waiting requests, KV-cache usage and the prefix-cache hit rate; with speculative decoding a
second line gives the mean acceptance length, the acceptance rate and the per-position acceptance rates over the
same window, as vLLM's SpecDecoding metrics line does; with sparse KV offload a line gives the window's block hit
rate and blocks moved in, and the resident blocks now; with a KV connector that provides prefixes (a KV pool) a line
gives the window's external prefix cache hit rate.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from pagedserve.core.engine_core_output import SchedulerStats

logger = logging.getLogger(__name__)

DEFAULT_LOG_INTERVAL_S = 10.0


class LoggingStatLogger:
    """AsyncLLM's StatLogger that writes the periodic log line (module docstring)."""

    def __init__(self, interval_s: float = DEFAULT_LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s!r} must be > 0")
        self.interval_s = interval_s
        self.clock = clock
        self._window_start = clock()
        self._window_stats = SchedulerStats()  # cumulative counters at the window's start
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        now = self.clock()
        elapsed = now - self._window_start
        if elapsed < self.interval_s:
            return
        before = self._window_stats
        queries = stats.prefix_cache_queries - before.prefix_cache_queries
        hits = stats.prefix_cache_hits - before.prefix_cache_hits
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d "
                    "reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                    self._num_prompt_tokens / elapsed, self._num_generation_tokens / elapsed,
                    stats.num_running_requests, stats.num_waiting_requests, stats.kv_cache_usage * 100,
                    100 * hits / queries if queries else 0.0)
        for line in (spec_decode_log_line(before, stats, elapsed), sparse_kv_offload_log_line(before, stats),
                     external_prefix_cache_log_line(before, stats)):
            if line is not None:
                logger.info("%s", line)
        self._window_start = now
        self._window_stats = stats
        self._num_prompt_tokens = self._num_generation_tokens = 0

    def record_first_token(self, time_to_first_token: float) -> None:
        pass

    def record_inter_token(self, inter_token_latency: float) -> None:
        pass

    def record_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self._num_prompt_tokens += num_prompt_tokens
        self._num_generation_tokens += num_generation_tokens

    def record_finished(self, finish_reason: str, e2e_latency: float) -> None:
        pass


def spec_decode_log_line(before: SchedulerStats, now: SchedulerStats, elapsed_s: float) -> str | None:
    """The SpecDecoding line for the counters' growth from `before` to `now`; None when nothing was drafted."""
    num_drafts = now.spec_decode_num_drafts - before.spec_decode_num_drafts
    if num_drafts <= 0:
        return None
    num_draft_tokens = now.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    num_accepted = now.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    earlier = before.spec_decode_num_accepted_tokens_per_pos
    per_position = [count - (earlier[i] if i < len(earlier) else 0)
                    for i, count in enumerate(now.spec_decode_num_accepted_tokens_per_pos)]
    rates = ", ".join(f"{count / num_drafts:.3f}" for count in per_position)
    return (f"SpecDecoding metrics: Mean acceptance length: {1 + num_accepted / num_drafts:.2f}, "
            f"Accepted throughput: {num_accepted / elapsed_s:.2f} tokens/s, Drafted throughput: "
            f"{num_draft_tokens / elapsed_s:.2f} tokens/s, Accepted: {num_accepted} tokens, Drafted: "
            f"{num_draft_tokens} tokens, Per-position acceptance rate: {rates}, Avg Draft acceptance rate: "
            f"{100 * num_accepted / num_draft_tokens if num_draft_tokens else 0.0:.1f}%")


def sparse_kv_offload_log_line(before: SchedulerStats, now: SchedulerStats) -> str | None:
    """The sparse KV offload line for the window from `before` to `now`; None while offload is off."""
    offload = now.sparse_kv_offload
    if offload is None:
        return None
    earlier = before.sparse_kv_offload
    hits = offload.num_block_hits - (earlier.num_block_hits if earlier else 0)
    misses = offload.num_block_misses - (earlier.num_block_misses if earlier else 0)
    moved_in = offload.num_blocks_moved_in - (earlier.num_blocks_moved_in if earlier else 0)
    return (f"Sparse KV offload: block hit rate {100 * hits / (hits + misses) if hits + misses else 0.0:.1f}%, "
            f"blocks moved in: {moved_in}, resident blocks: {offload.num_resident_blocks} in "
            f"{offload.num_resident_buffers} buffers")


def external_prefix_cache_log_line(before: SchedulerStats, now: SchedulerStats) -> str | None:
    """The KV connector's prefix hit rate over the window (vLLM's "External prefix cache hit rate"); None when it was
    asked about nothing."""
    queries = now.external_prefix_cache_queries - before.external_prefix_cache_queries
    if queries <= 0:
        return None
    hits = now.external_prefix_cache_hits - before.external_prefix_cache_hits
    return f"External prefix cache hit rate: {100 * hits / queries:.1f}% ({hits} of {queries} tokens)"


class StatLoggers:
    """Hands every record to each of several stat loggers, in order."""

    def __init__(self, loggers: Sequence[object]) -> None:
        self.loggers = list(loggers)

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        for stat_logger in self.loggers:
            stat_logger.record_scheduler_stats(stats)  # type: ignore[attr-defined]

    def record_first_token(self, time_to_first_token: float) -> None:
        for stat_logger in self.loggers:
            stat_logger.record_first_token(time_to_first_token)  # type: ignore[attr-defined]

    def record_inter_token(self, inter_token_latency: float) -> None:
        for stat_logger in self.loggers:
            stat_logger.record_inter_token(inter_token_latency)  # type: ignore[attr-defined]

    def record_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        for stat_logger in self.loggers:
            stat_logger.record_tokens(num_prompt_tokens, num_generation_tokens)  # type: ignore[attr-defined]

    def record_finished(self, finish_reason: str, e2e_latency: float) -> None:
        for stat_logger in self.loggers:
            stat_logger.record_finished(finish_reason, e2e_latency)  # type: ignore[attr-defined]
