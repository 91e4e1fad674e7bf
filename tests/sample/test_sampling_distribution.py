"""Chi-square tests: sampled tokens follow softmax(logits / T), truncated and renormalised as specified.

Every case draws 20,000 samples of one small-vocab row (batched as 20,000 identical rows, one call)
under a fixed global seed, so the test is deterministic; the reference distribution is computed
independently in float64 Python.
"""
from __future__ import annotations

import math

import pytest
import torch

from chi_square import chi_square_critical_value
from pagedserve.sampling_params import SamplingParams

NUM_SAMPLES = 20_000
# Every goodness-of-fit test runs at chi_square.SIGNIFICANCE (fixed seeds make the outcome deterministic).


def chi_square_statistic(observed: list[int], expected: list[float]) -> float:
    return sum((seen - wanted) ** 2 / wanted for seen, wanted in zip(observed, expected))


LOGITS = [1.2, -0.3, 0.8, 2.0, -1.5, 0.0, 1.7, 0.4, -0.8, 1.0, 0.6, -2.2]


def reference_distribution(logits: list[float], temperature: float, top_k: int, top_p: float,
                           min_p: float) -> list[float]:
    """Spec, written plainly: softmax(l / T); min-p; top-k; renormalise; top-p (smallest prefix >= p)."""
    scaled = [value / temperature for value in logits]
    peak = max(scaled)
    weights = [math.exp(value - peak) for value in scaled]
    probs = [weight / sum(weights) for weight in weights]
    kept = set(range(len(logits)))
    if min_p > 0:
        kept = {token for token in kept if probs[token] >= min_p * max(probs)}
    order = sorted(kept, key=lambda token: -probs[token])
    if top_k > 0:
        order = order[:top_k]
    if top_p < 1.0:
        mass = sum(probs[token] for token in order)
        nucleus, cumulative = [], 0.0
        for token in order:
            nucleus.append(token)
            cumulative += probs[token] / mass
            if cumulative >= top_p:
                break
        order = nucleus
    mass = sum(probs[token] for token in order)
    return [probs[token] / mass if token in order else 0.0 for token in range(len(logits))]


CASES = {
    "temperature_1": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "temperature_0.6": dict(temperature=0.6, top_k=0, top_p=1.0, min_p=0.0),
    "temperature_2.5": dict(temperature=2.5, top_k=0, top_p=1.0, min_p=0.0),
    "top_k_5": dict(temperature=1.3, top_k=5, top_p=1.0, min_p=0.0),
    "top_p_0.7": dict(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0),
    "min_p_0.2": dict(temperature=1.1, top_k=0, top_p=1.0, min_p=0.2),
    "top_k_top_p": dict(temperature=1.5, top_k=7, top_p=0.8, min_p=0.0),
    "all_three": dict(temperature=1.8, top_k=8, top_p=0.9, min_p=0.1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_frequencies_match_distribution(sample, case: str) -> None:
    settings = CASES[case]
    expected = reference_distribution(LOGITS, **settings)
    params = [SamplingParams(**settings)] * NUM_SAMPLES
    logits = torch.tensor([LOGITS] * NUM_SAMPLES, dtype=torch.float32)
    torch.manual_seed(1234)
    counts = torch.bincount(sample(logits, params).sampled_token_ids, minlength=len(LOGITS)).tolist()
    support = [token for token, probability in enumerate(expected) if probability > 0]
    # Dropped tokens must never be drawn.
    assert all(counts[token] == 0 for token in range(len(LOGITS)) if token not in support), (counts, expected)
    # The truncation must actually bite in the truncating cases (guards against a vacuous test).
    if case not in ("temperature_1", "temperature_0.6", "temperature_2.5"):
        assert len(support) < len(LOGITS)
    statistic = chi_square_statistic([counts[token] for token in support],
                                     [expected[token] * NUM_SAMPLES for token in support])
    if len(support) == 1:
        assert counts[support[0]] == NUM_SAMPLES
    else:
        assert statistic < chi_square_critical_value(len(support) - 1), (
            case, statistic, counts, [round(e * NUM_SAMPLES) for e in expected])


def test_chi_square_rejects_a_wrong_distribution(sample) -> None:
    """The test has power: temperature 1.0 samples are rejected against the temperature 1.2 law."""
    params = [SamplingParams(temperature=1.0)] * NUM_SAMPLES
    logits = torch.tensor([LOGITS] * NUM_SAMPLES, dtype=torch.float32)
    torch.manual_seed(1234)
    counts = torch.bincount(sample(logits, params).sampled_token_ids, minlength=len(LOGITS)).tolist()
    wrong = reference_distribution(LOGITS, temperature=1.2, top_k=0, top_p=1.0, min_p=0.0)
    statistic = chi_square_statistic(counts, [probability * NUM_SAMPLES for probability in wrong])
    assert statistic > chi_square_critical_value(len(LOGITS) - 1)


def test_unseeded_rows_differ_across_calls(sample) -> None:
    logits = torch.zeros(1, 1000)
    draws = {int(sample(logits, [SamplingParams()]).sampled_token_ids[0]) for _ in range(20)}
    assert len(draws) > 10
