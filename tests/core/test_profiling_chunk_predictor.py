"""Profiling-tuned chunk sizes: latency fit, chunk choice, smoothing, alignment, degenerate inputs."""
from __future__ import annotations

import random

import pytest

from pagedserve.core.profiling_chunk_predictor import (LatencyModel, LatencySample, ProfilingChunkPolicy,
                                                       fit_latency_model)

TRUE_MODEL = LatencyModel(intercept=0.004, linear=2e-5, quadratic=3e-9, history=5e-9)


def _samples(model: LatencyModel, points: list[tuple[int, int]], noise: float = 0.0,
             seed: int = 0) -> list[LatencySample]:
    rng = random.Random(seed)
    return [LatencySample(n, h, model.predict(n, h) * (1 + rng.uniform(-noise, noise))) for n, h in points]


NO_HISTORY = [(16, 0), (64, 0), (256, 0), (512, 0), (1024, 0), (2048, 0)]
WITH_HISTORY = NO_HISTORY + [(256, 1024), (256, 3072), (512, 2048)]


def test_exact_fit_on_synthetic_quadratic() -> None:
    fitted = fit_latency_model(_samples(TRUE_MODEL, WITH_HISTORY))
    for name in ("intercept", "linear", "quadratic", "history"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE_MODEL, name), rel=1e-6), name
    without_history = fit_latency_model(_samples(TRUE_MODEL, NO_HISTORY))
    assert without_history.history == 0.0
    assert without_history.quadratic == pytest.approx(TRUE_MODEL.quadratic, rel=1e-6)
    assert without_history.intercept == pytest.approx(TRUE_MODEL.intercept, rel=1e-6)


def test_noisy_fit_recovers_coefficients_and_chunks() -> None:
    fitted = fit_latency_model(_samples(TRUE_MODEL, WITH_HISTORY * 4, noise=0.02, seed=1))
    assert fitted.linear == pytest.approx(TRUE_MODEL.linear, rel=0.1)
    assert fitted.quadratic == pytest.approx(TRUE_MODEL.quadratic, rel=0.2)
    # The chunks it picks cost about the budget under the true model.
    policy = ProfilingChunkPolicy(fitted, step_budget_seconds=0.05, block_size=16, max_chunk=8192, min_chunk=16)
    for history in (0, 1024, 4096):
        chunk = policy.largest_fitting_chunk(16, history)
        assert TRUE_MODEL.predict(16 + chunk, history) == pytest.approx(0.05, rel=0.05)


def test_chunk_choice_for_budgets() -> None:
    linear = LatencyModel(intercept=0.01, linear=1e-5, quadratic=0.0)
    policy = ProfilingChunkPolicy(linear, step_budget_seconds=0.02, block_size=16, max_chunk=4096, min_chunk=16)
    # 0.01 + 1e-5 * (16 + n) <= 0.02  ->  n <= 984  ->  aligned down to 976.
    assert policy.largest_fitting_chunk(16, 0) == 984
    assert policy.prefill_token_cap(16, 0) == 976
    quadratic = LatencyModel(intercept=0.0, linear=0.0, quadratic=1e-6)
    policy = ProfilingChunkPolicy(quadratic, step_budget_seconds=1.0, block_size=16, max_chunk=4096, min_chunk=16)
    assert policy.prefill_token_cap(0, 0) == 992  # n <= 1000
    # History makes the same budget buy a shorter chunk.
    with_history = LatencyModel(intercept=0.0, linear=1e-4, quadratic=0.0, history=1e-7)
    policy = ProfilingChunkPolicy(with_history, step_budget_seconds=0.1, block_size=16, max_chunk=4096, min_chunk=16)
    assert policy.largest_fitting_chunk(0, 0) == 1000
    assert policy.largest_fitting_chunk(0, 1000) == 500  # n * (1e-4 + 1e-4) <= 0.1
    # A generous budget is capped by max_chunk; a budget nothing fits gives the floor.
    generous = ProfilingChunkPolicy(linear, step_budget_seconds=10.0, block_size=16, max_chunk=1000, min_chunk=16)
    assert generous.prefill_token_cap(0, 0) == 992  # max_chunk 1000, aligned down
    starved = ProfilingChunkPolicy(linear, step_budget_seconds=0.005, block_size=16, max_chunk=4096, min_chunk=100)
    assert starved.largest_fitting_chunk(0, 0) == 0
    assert starved.prefill_token_cap(0, 0) == 96  # the floor, aligned down to the block size


def test_smoothing_is_an_ema() -> None:
    linear = LatencyModel(intercept=0.0, linear=1e-3, quadratic=0.0)
    policy = ProfilingChunkPolicy(linear, step_budget_seconds=1.0, block_size=16, max_chunk=4096, min_chunk=16,
                                  smoothing=0.5)
    assert policy.prefill_token_cap(0, 0) == 992  # first choice: raw 1000, aligned
    # Raw 200 now (800 other tokens): EMA 0.5 * 200 + 0.5 * 1000 = 600 -> 592.
    assert policy.prefill_token_cap(800, 0) == 592
    # Raw 200 again: 0.5 * 200 + 0.5 * 600 = 400 -> 400.
    assert policy.prefill_token_cap(800, 0) == 400
    unsmoothed = ProfilingChunkPolicy(linear, step_budget_seconds=1.0, block_size=16, max_chunk=4096, min_chunk=16)
    unsmoothed.prefill_token_cap(0, 0)
    assert unsmoothed.prefill_token_cap(800, 0) == 192


def test_degenerate_inputs() -> None:
    with pytest.raises(ValueError, match="at least 3"):
        fit_latency_model([LatencySample(64, 0, 0.1), LatencySample(128, 0, 0.2), LatencySample(64, 0, 0.1)])
    with pytest.raises(ValueError, match="at least 3"):
        fit_latency_model([])
    with pytest.raises(ValueError, match="seconds"):
        fit_latency_model([LatencySample(16, 0, -1.0)] * 3)
    # History always proportional to n: the history column equals the quadratic one -> singular.
    with pytest.raises(ValueError, match="do not determine"):
        fit_latency_model(_collinear_history_samples())
    # A concave (noisy, almost linear) curve: the negative quadratic term is dropped.
    concave = [LatencySample(n, 0, 0.01 + 1e-4 * n - 1e-9 * n * n) for n in (16, 256, 1024, 2048)]
    fitted = fit_latency_model(concave)
    assert fitted.quadratic == 0.0 and fitted.linear > 0
    # Larger chunks timed slow (a busy machine while the engine profiled): the unconstrained fit has a negative
    # intercept and predicts <= 0 s for a few tokens, so any budget would admit them. Every coefficient is
    # kept >= 0, so predictions never fall below 0 nor decrease with n.
    slow_start = [LatencySample(n, 0, seconds) for n, seconds in ((8, 0.0001), (16, 0.0004), (32, 0.0025),
                                                                   (64, 0.0055), (128, 0.0125))]
    fitted = fit_latency_model(slow_start)
    assert min(fitted.intercept, fitted.linear, fitted.quadratic, fitted.history) >= 0
    predictions = [fitted.predict(n) for n in range(1, 129)]
    assert predictions == sorted(predictions) and predictions[0] > 1e-5
    assert ProfilingChunkPolicy(fitted, 1e-5, 16, 128, 16).largest_fitting_chunk(0, 0) == 0
    with pytest.raises(ValueError, match="smoothing=0"):
        ProfilingChunkPolicy(fitted, 0.1, 16, 1024, 16, smoothing=0)
    with pytest.raises(ValueError, match="step_budget_seconds=0"):
        ProfilingChunkPolicy(fitted, 0, 16, 1024, 16)


def _collinear_history_samples() -> list[LatencySample]:
    # n * h = 2 * n^2 on every sample: the history and quadratic columns are identical.
    return [LatencySample(n, 2 * n, 0.001 * n) for n in (8, 24, 48)]
