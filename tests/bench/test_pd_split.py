"""`pagedserve bench pd`'s arithmetic on given capacities: P and D rates under the SLOs, the best xPyD."""
from __future__ import annotations

import pytest

from pagedserve.bench.pd_split import (DecodeRate, PrefillRate, colocated_requests_per_second, decode_rate, explain,
                                       prefill_rate, recommend_split, splits, step_seconds_at)


def test_prefill_rate_is_the_m_d_1_bound_within_the_ttft_slo():
    # s = 0.1 s, T = 0.5 s, first step 0.02 s: d = 0.38, rho_max = 0.76 / 0.86, rate = rho_max / 0.1.
    rate = prefill_rate(0.1, 0.5, 0.02)
    assert rate.slack_seconds == pytest.approx(0.38)
    assert rate.max_utilisation == pytest.approx(0.76 / 0.86)
    assert rate.requests_per_second == pytest.approx(0.76 / 0.86 / 0.1)
    # At that utilisation the M/D/1 mean wait plus the service and the first step is exactly the SLO.
    rho, s = rate.max_utilisation, rate.service_seconds
    assert s + rho * s / (2 * (1 - rho)) + 0.02 == pytest.approx(0.5)
    assert prefill_rate(0.6, 0.5).requests_per_second == 0.0  # one prompt alone misses the SLO
    with pytest.raises(ValueError, match="service_seconds"):
        prefill_rate(0.0, 0.5)


def test_decode_rate_takes_the_largest_batch_within_the_tpot_slo():
    steps = {1: 0.010, 4: 0.016, 16: 0.040, 32: 0.080}
    assert step_seconds_at(steps, 8) == pytest.approx(0.016 + 4 * 0.024 / 12)
    assert step_seconds_at(steps, 64) == pytest.approx(0.080 + 32 * 0.040 / 16)  # the last segment, extended
    rate = decode_rate(steps, mean_output_tokens=100, tpot_slo_seconds=0.050)
    # t(B) = 0.040 + (B - 16) * 0.0025 <= 0.050 up to B = 20 (t = 0.050).
    assert rate.batch_size == 20 and rate.step_seconds == pytest.approx(0.050)
    assert rate.requests_per_second == pytest.approx(20 / (0.050 * 100))
    assert decode_rate(steps, 100, 0.005).batch_size == 0  # even batch 1 is too slow
    assert decode_rate(steps, 100, 1.0).batch_size == 32  # capped at the largest measured
    assert decode_rate(steps, 100, 1.0, max_batch_size=8).batch_size == 8


def test_recommended_split_serves_the_most_within_the_slos():
    prefill = PrefillRate(0.1, 0.4, 0.9, 3.0)
    decode = DecodeRate(16, 0.05, 5.0)
    assert [(split.name, split.requests_per_second) for split in splits(prefill, decode, 4)] == [
        ("1P3D", 3.0), ("2P2D", 6.0), ("3P1D", 5.0)]
    assert recommend_split(prefill, decode, 4).name == "2P2D"
    assert recommend_split(prefill, decode, 2).name == "1P1D"
    # A tie goes to the fewer prefill instances (1P2D and 2P1D both serve 3.0 here).
    assert recommend_split(PrefillRate(0.1, 0.4, 0.9, 3.0), DecodeRate(16, 0.05, 3.0), 3).name == "1P2D"
    assert colocated_requests_per_second(prefill, decode, 2) == pytest.approx(2 / (0.1 + 0.2))
    text = explain(prefill, decode, 4, 0.5, 0.05, 100, 0.0)
    assert "2P2D: min(2 x 3.00, 2 x 5.00) = 6.00 req/s" in text
    assert text.endswith("recommended for 4 instances: 2P2D (6.00 req/s within the SLOs)")
    with pytest.raises(ValueError, match="num_instances"):
        splits(prefill, decode, 1)
