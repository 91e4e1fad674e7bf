"""The periodic engine log line (vLLM's), its SpecDecoding line, and the fan-out to several stat loggers."""
from __future__ import annotations

import logging

import pytest

from pagedserve.core.engine_core_output import SchedulerStats
from pagedserve.engine.stat_loggers import LoggingStatLogger, StatLoggers, external_prefix_cache_log_line


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_log_line_every_interval_with_window_rates(caplog) -> None:
    clock = FakeClock()
    stat_logger = LoggingStatLogger(interval_s=10.0, clock=clock)
    caplog.set_level(logging.INFO, logger="pagedserve.engine.stat_loggers")
    stat_logger.record_tokens(200, 0)
    stat_logger.record_tokens(0, 50)
    clock.now += 5
    stat_logger.record_scheduler_stats(SchedulerStats(num_running_requests=3))
    assert caplog.records == []  # within the interval
    clock.now += 5
    stat_logger.record_scheduler_stats(SchedulerStats(
        num_running_requests=3, num_waiting_requests=1, kv_cache_usage=0.25, prefix_cache_queries=100,
        prefix_cache_hits=40, spec_decode_num_drafts=10, spec_decode_num_draft_tokens=30,
        spec_decode_num_accepted_tokens=15, spec_decode_num_accepted_tokens_per_pos=[8, 5, 2]))
    lines = [record.getMessage() for record in caplog.records]
    assert lines[0] == ("Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 3 "
                        "reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 40.0%")
    assert lines[1].startswith("SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 1.50 "
                               "tokens/s, Drafted throughput: 3.00 tokens/s, Accepted: 15 tokens, Drafted: 30 tokens")
    assert lines[1].endswith("Per-position acceptance rate: 0.800, 0.500, 0.200, Avg Draft acceptance rate: 50.0%")
    # The next window counts only what grew since; no drafts in it, no SpecDecoding line.
    caplog.clear()
    clock.now += 10
    stat_logger.record_scheduler_stats(SchedulerStats(
        prefix_cache_queries=100, prefix_cache_hits=40, spec_decode_num_drafts=10, spec_decode_num_draft_tokens=30,
        spec_decode_num_accepted_tokens=15, spec_decode_num_accepted_tokens_per_pos=[8, 5, 2]))
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and "Avg generation throughput: 0.0 tokens/s" in lines[0]
    assert "Prefix cache hit rate: 0.0%" in lines[0]


def test_fan_out_reaches_every_logger() -> None:
    calls: list[tuple[str, tuple]] = []

    class Recorder:
        def __getattr__(self, name):
            return lambda *args: calls.append((name, args))

    loggers = StatLoggers([Recorder(), Recorder()])
    loggers.record_tokens(1, 2)
    loggers.record_first_token(0.5)
    loggers.record_inter_token(0.1)
    loggers.record_finished("stop", 1.0)
    stats = SchedulerStats()
    loggers.record_scheduler_stats(stats)
    assert [name for name, _ in calls] == ["record_tokens"] * 2 + ["record_first_token"] * 2 + \
        ["record_inter_token"] * 2 + ["record_finished"] * 2 + ["record_scheduler_stats"] * 2


def test_bad_interval() -> None:
    with pytest.raises(ValueError, match="interval_s=0"):
        LoggingStatLogger(interval_s=0)


def test_external_prefix_cache_log_line() -> None:
    before = SchedulerStats(external_prefix_cache_queries=100, external_prefix_cache_hits=10)
    assert external_prefix_cache_log_line(before, before) is None
    now = SchedulerStats(external_prefix_cache_queries=300, external_prefix_cache_hits=160)
    assert external_prefix_cache_log_line(before, now) == "External prefix cache hit rate: 75.0% (150 of 200 tokens)"
