"""The offload counters cross the engine <-> server codec inside SchedulerStats, and the worker's step result
inside ModelRunnerOutput (multiprocess executor)."""
from __future__ import annotations

import msgspec

from pagedserve.core.engine_core_output import SchedulerStats
from pagedserve.core.scheduler_output import ModelRunnerOutput
from pagedserve.core.sparse_kv_offload_stats import SparseKVOffloadStats
from pagedserve.engine.messages import EngineCoreOutputs, MessageCodec

STATS = SparseKVOffloadStats(num_block_hits=7, num_block_misses=3, num_blocks_moved_in=3, num_blocks_evicted=1,
                             num_tokens_moved_out=40, num_multi_round_gathers=1, num_resident_blocks=5,
                             num_resident_buffers=2)


def test_scheduler_stats_carry_the_offload_counters() -> None:
    codec = MessageCodec()
    stats = SchedulerStats(num_running_requests=1, sparse_kv_offload=STATS)
    decoded = codec.decode_output(codec.encode(EngineCoreOutputs(outputs=[], stats=stats, timestamp=0.0)))
    assert decoded.stats.sparse_kv_offload == STATS
    assert decoded.stats.sparse_kv_offload.hit_rate == 0.7


def test_model_runner_output_carries_the_offload_counters() -> None:
    output = ModelRunnerOutput(request_ids=["a"], sampled_token_ids=[[3]], sparse_kv_offload_stats=STATS)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(output), type=ModelRunnerOutput)
    assert decoded == output


def test_metrics_name_the_offload_counters_only_while_offload_is_on() -> None:
    from prometheus_client import generate_latest

    from pagedserve.engine.metrics_reader import scheduler_stats_to_metrics
    from pagedserve.server.metrics import ServerMetrics

    assert not [m for m in scheduler_stats_to_metrics(SchedulerStats(), "m") if "sparse_kv_offload" in m.name]
    metrics = {m.name: m.value for m in scheduler_stats_to_metrics(SchedulerStats(sparse_kv_offload=STATS), "m")
               if "sparse_kv_offload" in m.name}
    assert metrics["pagedserve:sparse_kv_offload_block_hits"] == 7
    assert metrics["pagedserve:sparse_kv_offload_blocks_moved_in"] == 3
    assert metrics["pagedserve:sparse_kv_offload_resident_blocks"] == 5.0
    server = ServerMetrics("m")
    server.record_scheduler_stats(SchedulerStats(sparse_kv_offload=STATS))
    text = generate_latest(server.registry).decode()
    assert 'pagedserve:sparse_kv_offload_block_misses_total{model_name="m"} 3.0' in text
    assert 'pagedserve:sparse_kv_offload_resident_buffers{model_name="m"} 2.0' in text


def test_the_periodic_log_line_reports_the_window_hit_rate() -> None:
    from pagedserve.engine.stat_loggers import sparse_kv_offload_log_line

    assert sparse_kv_offload_log_line(SchedulerStats(), SchedulerStats()) is None
    later = SparseKVOffloadStats(num_block_hits=9, num_block_misses=5, num_blocks_moved_in=5, num_resident_blocks=4,
                                 num_resident_buffers=2)
    line = sparse_kv_offload_log_line(SchedulerStats(sparse_kv_offload=STATS), SchedulerStats(sparse_kv_offload=later))
    assert line == "Sparse KV offload: block hit rate 50.0%, blocks moved in: 2, resident blocks: 4 in 2 buffers"
