"""ServerMetrics turns the engine's cumulative SchedulerStats into Prometheus counters with vLLM's names (here the
speculative-decoding ones): each record advances a counter by what grew since the last."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagedserve.core.engine_core_output import SchedulerStats
from pagedserve.server.metrics import ServerMetrics


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(metrics.render().decode())
            for sample in family.samples}


def test_spec_decode_counters_advance_by_the_growth() -> None:
    metrics = ServerMetrics("tiny")
    metrics.record_scheduler_stats(SchedulerStats(spec_decode_num_drafts=2, spec_decode_num_draft_tokens=6,
                                                  spec_decode_num_accepted_tokens=3,
                                                  spec_decode_num_accepted_tokens_per_pos=[2, 1]))
    metrics.record_scheduler_stats(SchedulerStats(spec_decode_num_drafts=5, spec_decode_num_draft_tokens=15,
                                                  spec_decode_num_accepted_tokens=7,
                                                  spec_decode_num_accepted_tokens_per_pos=[4, 2, 1]))
    samples = _samples(metrics)
    model = ("model_name", "tiny")
    assert samples[("vllm:spec_decode_num_drafts_total", (model,))] == 5
    assert samples[("vllm:spec_decode_num_draft_tokens_total", (model,))] == 15
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", (model,))] == 7
    per_position = {dict(labels)["position"]: value for (name, labels), value in samples.items()
                    if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_position == {"0": 4, "1": 2, "2": 1}
