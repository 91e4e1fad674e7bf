"""min-p, top-k and top-p keep exactly the intended tokens on crafted logits."""
from __future__ import annotations

import math

import pytest
import torch

from pagedserve.sample.truncation import apply_min_p, apply_top_k, apply_top_k_top_p

# Probabilities 0.4, 0.3, 0.2, 0.1 placed at shuffled vocabulary positions (tests the un-sort scatter).
POSITIONS = [3, 0, 4, 1]  # POSITIONS[i] holds the i-th most likely token
VOCAB_SIZE = 6


def crafted_logits() -> torch.Tensor:
    logits = torch.full((1, VOCAB_SIZE), float("-inf"))
    for probability, position in zip([0.4, 0.3, 0.2, 0.1], POSITIONS):
        logits[0, position] = math.log(probability)
    return logits


def kept_tokens(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())


def expected_kept(num_most_likely: int) -> set[int]:
    return set(POSITIONS[:num_most_likely])


@pytest.mark.parametrize("top_p, num_kept", [(0.01, 1), (0.3, 1), (0.45, 2), (0.65, 2), (0.75, 3),
                                             (0.85, 3), (0.95, 4), (1.0, 4)])
def test_top_p_keeps_smallest_set_reaching_p(top_p: float, num_kept: int) -> None:
    logits = apply_top_k_top_p(crafted_logits(), None, torch.tensor([top_p]))
    assert kept_tokens(logits) == expected_kept(num_kept)


@pytest.mark.parametrize("top_k, num_kept", [(1, 1), (2, 2), (3, 3), (4, 4), (6, 4)])
def test_top_k_keeps_k_largest(top_k: int, num_kept: int) -> None:
    sorted_path = apply_top_k_top_p(crafted_logits(), torch.tensor([top_k]), torch.tensor([1.0]))
    assert kept_tokens(sorted_path) == expected_kept(num_kept)
    if top_k < VOCAB_SIZE:
        topk_path = apply_top_k(crafted_logits(), torch.tensor([top_k]), max_top_k=top_k)
        assert kept_tokens(topk_path) == expected_kept(num_kept)
        candidate_path = apply_top_k_top_p(crafted_logits(), torch.tensor([top_k]), torch.tensor([1.0]),
                                           max_top_k=top_k)
        assert kept_tokens(candidate_path) == expected_kept(num_kept)


def test_top_p_applies_to_top_k_renormalised_distribution() -> None:
    # After top-k 3 the mass is 0.4/0.9, 0.3/0.9, 0.2/0.9: the first two reach 0.78 >= 0.75, whereas
    # on the unrenormalised distribution they only reach 0.7 and a third token would be needed.
    for max_top_k in (None, 3, 5):  # full sort, and the candidates-only path
        logits = apply_top_k_top_p(crafted_logits(), torch.tensor([3]), torch.tensor([0.75]), max_top_k)
        assert kept_tokens(logits) == expected_kept(2)


def test_top_k_per_row_with_disabled_rows() -> None:
    logits = apply_top_k(torch.cat([crafted_logits()] * 3), torch.tensor([1, VOCAB_SIZE, 3]), max_top_k=3)
    assert [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits] == [
        expected_kept(1), expected_kept(4), expected_kept(3)]


def test_per_row_top_k_and_top_p() -> None:
    top_k, top_p = torch.tensor([1, 3, 4, 2]), torch.tensor([1.0, 0.75, 0.65, 0.95])
    expected = [expected_kept(1), expected_kept(2), expected_kept(2), expected_kept(2)]
    for max_top_k in (None, 4):
        logits = apply_top_k_top_p(torch.cat([crafted_logits()] * 4), top_k, top_p, max_top_k)
        assert [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits] == expected


def test_kept_logits_unchanged() -> None:
    original = crafted_logits()
    for max_top_k in (None, 2):
        logits = apply_top_k_top_p(crafted_logits(), torch.tensor([2]), torch.tensor([0.9]), max_top_k)
        assert kept_tokens(logits) == expected_kept(2)
        for position in expected_kept(2):
            assert logits[0, position] == original[0, position]


@pytest.mark.parametrize("min_p, num_kept", [(0.0, 4), (0.2, 4), (0.45, 3), (0.55, 2), (0.8, 1), (1.0, 1)])
def test_min_p_relative_to_top_probability(min_p: float, num_kept: int) -> None:
    logits = apply_min_p(crafted_logits(), torch.tensor([min_p]))
    assert kept_tokens(logits) == expected_kept(num_kept)
