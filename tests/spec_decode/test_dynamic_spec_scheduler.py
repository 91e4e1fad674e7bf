"""DynamicSpecScheduler (per-request verify lengths), DSpark's Markov head and DFlash's confidence."""
from __future__ import annotations

import pytest
import torch

from pagedserve.spec_decode.dynamic_spec_scheduler import (DynamicSpecParams, DynamicSpecScheduler,
                                                            dflash_confidence, markov_corrected_drafts)


def _scheduler(num_speculative_tokens: int, **params: object) -> DynamicSpecScheduler:
    return DynamicSpecScheduler(DynamicSpecParams(**params), num_speculative_tokens)


def _step_confidences(num_confident: list[int], num_speculative_tokens: int) -> torch.Tensor:
    """Row b: confidence 1 for its first num_confident[b] drafts, then 0.1 (survival 1, then <= 0.1)."""
    positions = torch.arange(num_speculative_tokens)
    return torch.where(positions < torch.tensor(num_confident)[:, None], 1.0, 0.1)


def _reference_lengths(survival: torch.Tensor, min_k: int, budget_k: int) -> list[int]:
    """The allocation rule written out: min_k each, then the largest S[b, j >= min_k] with ties to lower (b, j)."""
    batch_size, num_tokens = survival.shape
    candidates = sorted(((-survival[b, j].item(), b, j) for b in range(batch_size) for j in range(min_k, num_tokens)))
    chosen = candidates[:batch_size * (budget_k - min_k)]
    lengths = [min_k] * batch_size
    for b in range(batch_size):
        chosen_columns = sorted(j for _, row, j in chosen if row == b)
        # The rule itself must pick a prefix of each row's window, ties included.
        assert chosen_columns == list(range(min_k, min_k + len(chosen_columns)))
        lengths[b] += len(chosen_columns)
    return lengths


def test_worked_example_by_hand() -> None:
    # K = 4, min_k = 1, budget 2: each request verifies 1 draft, and 3 * (2 - 1) = 3 extra slots are shared.
    scheduler = _scheduler(4, initial_verify_budget_per_req=2, budget_update_interval=100, min_verify_tokens=1)
    confidence = torch.tensor([[0.9, 0.9, 0.5, 0.5],    # S = [0.9, 0.81, 0.405, 0.2025]
                               [0.5, 0.5, 1.0, 1.0],    # S = [0.5, 0.25, 0.25, 0.25]
                               [1.0, 0.8, 0.8, 0.8]])   # S = [1.0, 0.8, 0.64, 0.512]
    # Window j >= 1, largest three: 0.81 (row 0), 0.8 and 0.64 (row 2). Lengths 1 + [1, 0, 2].
    lengths = scheduler.verify_lengths(confidence)
    assert lengths.dtype == torch.int64
    assert lengths.tolist() == [2, 1, 3]
    assert scheduler.budget_k == 2

    # Same confidences on an update call (interval 1, threshold 0.3): survivals >= 0.3 are 3 + 1 + 4 = 8,
    # 8 / 3 = 2.67 -> k* = 3 (odd, kept). 3 * (3 - 1) = 6 extra slots: 0.81, 0.8, 0.64, 0.512, 0.405, then one
    # of row 1's three tied 0.25s, its j = 1. Lengths 1 + [2, 1, 3].
    scheduler = _scheduler(4, initial_verify_budget_per_req=2, budget_update_interval=1, budget_threshold=0.3)
    assert scheduler.verify_lengths(confidence).tolist() == [3, 2, 4]
    assert scheduler.budget_k == 3


def test_ties_go_to_the_lower_request_then_the_lower_draft() -> None:
    # Every survival is 1: the 3 extra slots go to request 0's drafts 1, 2, 3.
    scheduler = _scheduler(4, initial_verify_budget_per_req=2, budget_update_interval=100)
    assert scheduler.verify_lengths(torch.ones(3, 4)).tolist() == [4, 1, 1]


@pytest.mark.parametrize("seed", range(40))
def test_allocation_is_a_prefix_of_the_largest_survivals(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    batch_size = int(torch.randint(1, 9, (), generator=generator))
    num_tokens = int(torch.randint(1, 9, (), generator=generator))
    min_k = int(torch.randint(0, num_tokens + 1, (), generator=generator))
    budget = int(torch.randint(1, num_tokens + 1, (), generator=generator))
    scheduler = _scheduler(num_tokens, initial_verify_budget_per_req=budget, budget_update_interval=1000,
                           min_verify_tokens=min_k)
    # Few distinct values, so survivals tie often, within rows (confidence 1) and across them.
    levels = torch.tensor([0.5, 0.8, 1.0, 1.0, 0.0])
    confidence = levels[torch.randint(0, len(levels), (batch_size, num_tokens), generator=generator)]
    lengths = scheduler.verify_lengths(confidence)
    budget_k = max(min(budget, num_tokens), min_k)
    assert scheduler.budget_k == budget_k
    assert lengths.shape == (batch_size,)
    assert bool((lengths >= min_k).all()) and bool((lengths <= num_tokens).all())
    assert int(lengths.sum()) == batch_size * budget_k
    survival = torch.cumprod(confidence.clamp(1e-6, 1.0), dim=1)
    assert lengths.tolist() == _reference_lengths(survival, min_k, budget_k)
    # Every verified draft past min_k survives at least as likely as every unverified one.
    positions = torch.arange(num_tokens)
    is_verified = positions < lengths[:, None]
    window = positions >= min_k
    verified, unverified = survival[is_verified & window], survival[~is_verified & window]
    if len(verified) and len(unverified):
        assert float(verified.min()) >= float(unverified.max())


def test_min_k_and_k_bound_every_length() -> None:
    # Budget 2 of K = 5 with min_k = 2: no extra slots, everyone verifies exactly 2 whatever its confidence.
    scheduler = _scheduler(5, initial_verify_budget_per_req=2, min_verify_tokens=2)
    assert scheduler.verify_lengths(torch.tensor([[1.0] * 5, [1e-9] * 5])).tolist() == [2, 2]
    # Budget K: everyone verifies K, even the hopeless request.
    scheduler = _scheduler(3, initial_verify_budget_per_req=3, min_verify_tokens=1)
    assert scheduler.verify_lengths(torch.tensor([[1.0] * 3, [0.0] * 3])).tolist() == [3, 3]
    # min_k = 0: a doubtful request may verify nothing, its slots go to the confident one.
    scheduler = _scheduler(4, initial_verify_budget_per_req=2, min_verify_tokens=0)
    assert scheduler.verify_lengths(torch.tensor([[1.0] * 4, [0.01] * 4])).tolist() == [4, 0]


def test_initial_budget_is_clamped_to_min_k_and_k() -> None:
    assert DynamicSpecScheduler(DynamicSpecParams(), 8).budget_k == 5
    assert _scheduler(3, initial_verify_budget_per_req=5).budget_k == 3
    assert _scheduler(4, initial_verify_budget_per_req=1, min_verify_tokens=2).budget_k == 2
    assert _scheduler(4, initial_verify_budget_per_req=3, min_verify_tokens=0).budget_k == 3


def test_budget_changes_only_on_update_calls() -> None:
    num_tokens = 5
    scheduler = _scheduler(num_tokens, initial_verify_budget_per_req=1, budget_update_interval=4)
    confident = torch.ones(2, num_tokens)  # every survival 1 >= 0.3: k* = 5
    doubtful = torch.full((2, num_tokens), 0.1)  # no survival reaches 0.3: k* = 0 -> 1
    for call in range(1, 4):
        assert scheduler.verify_lengths(confident).tolist() == [1, 1]
        assert (scheduler.num_steps, scheduler.budget_k) == (call, 1)
    # Call 4 (= the interval) re-estimates first and already allocates with the new budget.
    assert scheduler.verify_lengths(confident).tolist() == [5, 5]
    assert (scheduler.num_steps, scheduler.budget_k) == (4, 5)
    for call in range(5, 8):
        assert scheduler.verify_lengths(doubtful).tolist() == [5, 5]
        assert (scheduler.num_steps, scheduler.budget_k) == (call, 5)
    assert scheduler.verify_lengths(doubtful).tolist() == [1, 1]
    assert (scheduler.num_steps, scheduler.budget_k) == (8, 1)


@pytest.mark.parametrize("num_confident, num_speculative_tokens, min_k, expected_budget", [
    ([3, 3], 5, 1, 3),   # k* = 3, odd: kept
    ([2, 2], 5, 1, 3),   # k* = 2, even and < K: 3
    ([4, 4], 5, 1, 5),   # k* = 4, even and < K: 5
    ([4, 4], 4, 1, 4),   # k* = 4 = K: stays even
    ([1, 2], 5, 1, 3),   # mean 1.5 -> k* = 2 -> 3
    ([1, 1, 2], 5, 1, 3),  # mean 4/3 -> ceil 2 -> 3
    ([1, 1], 5, 1, 1),   # k* = 1, odd: kept
    ([0, 0], 5, 0, 1),   # k* = 0, even: 1 even with min_k = 0
    ([0, 0], 5, 2, 2),   # k* = 0 -> 1, then clamped up to min_k = 2
    ([5, 5], 6, 1, 5),   # k* = 5, odd, < K: kept
])
def test_budget_update_rounds_up_and_bumps_even_budgets_below_k(
        num_confident: list[int], num_speculative_tokens: int, min_k: int, expected_budget: int) -> None:
    scheduler = _scheduler(num_speculative_tokens, budget_update_interval=1, budget_threshold=0.5,
                           min_verify_tokens=min_k)
    lengths = scheduler.verify_lengths(_step_confidences(num_confident, num_speculative_tokens))
    assert scheduler.budget_k == expected_budget
    assert int(lengths.sum()) == len(num_confident) * expected_budget


def test_nan_confidence_counts_as_lowest_and_low_precision_input_works() -> None:
    scheduler = _scheduler(3, initial_verify_budget_per_req=2, min_verify_tokens=1)
    confidence = torch.tensor([[float("nan")] * 3, [0.9] * 3])
    assert scheduler.verify_lengths(confidence).tolist() == [1, 3]
    assert scheduler.verify_lengths(confidence.bfloat16()).tolist() == [1, 3]
    assert scheduler.verify_lengths(torch.empty(0, 3)).tolist() == []


def test_markov_head_with_zero_w2_is_plain_argmax() -> None:
    generator = torch.Generator().manual_seed(0)
    batch_size, num_tokens, vocab_size, rank = 3, 4, 50, 8
    base_logits = torch.randn(batch_size, num_tokens, vocab_size, generator=generator)
    w1 = torch.randn(vocab_size, rank, generator=generator)
    drafts = markov_corrected_drafts(base_logits, torch.tensor([1, 7, 3]), w1, torch.zeros(rank, vocab_size))
    assert drafts.dtype == torch.int64
    assert torch.equal(drafts, base_logits.argmax(dim=-1))


def test_markov_head_corrects_with_the_previous_draft() -> None:
    # Rank 2, vocab 3. w1 @ w2 is the bias table T (row: previous token): after 0 favour 2, after 2 favour 1,
    # after 1 nothing.
    w1 = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
    w2 = torch.tensor([[0.0, 0.0, 2.0], [0.0, 3.0, 0.0]])
    base_logits = torch.tensor([[[0.0, 1.0, 0.5], [2.0, 1.0, 0.0]],
                                [[0.0, 1.0, 0.5], [2.0, 1.0, 0.0]]])
    # Row 0, seed 0: position 0 [0, 1, 0.5] + [0, 0, 2] -> d1 = 2 (plain argmax: 1); position 1 with the
    # previous draft 2: [2, 1, 0] + [0, 3, 0] -> d2 = 1 (plain: 0; biased by the seed instead: [2, 1, 2] -> 0).
    # Row 1, seed 1: no bias anywhere, the plain argmax [1, 0].
    drafts = markov_corrected_drafts(base_logits, torch.tensor([0, 1]), w1, w2)
    assert drafts.tolist() == [[2, 1], [1, 0]]


def test_markov_head_matches_a_per_request_loop() -> None:
    generator = torch.Generator().manual_seed(1)
    batch_size, num_tokens, vocab_size, rank = 4, 5, 40, 3
    base_logits = torch.randn(batch_size, num_tokens, vocab_size, generator=generator)
    w1 = torch.randn(vocab_size, rank, generator=generator)
    w2 = torch.randn(rank, vocab_size, generator=generator)
    seeds = torch.randint(0, vocab_size, (batch_size,), generator=generator)
    expected = []
    for b in range(batch_size):
        previous, row = int(seeds[b]), []
        for position in range(num_tokens):
            previous = int(torch.argmax(base_logits[b, position] + w1[previous] @ w2))
            row.append(previous)
        expected.append(row)
    assert markov_corrected_drafts(base_logits, seeds, w1, w2).tolist() == expected


def test_dflash_confidence_is_the_top_softmax_probability() -> None:
    logits = torch.randn(3, 4, 20, generator=torch.Generator().manual_seed(2))
    confidence = dflash_confidence(logits)
    assert confidence.shape == (3, 4)
    torch.testing.assert_close(confidence, torch.softmax(logits, dim=-1).max(dim=-1).values)
    assert dflash_confidence(torch.zeros(1, 1, 4)).tolist() == [[0.25]]


@pytest.mark.parametrize("params, field", [
    ({"initial_verify_budget_per_req": 0}, "initial_verify_budget_per_req"),
    ({"initial_verify_budget_per_req": 2.0}, "initial_verify_budget_per_req"),
    ({"budget_update_interval": 0}, "budget_update_interval"),
    ({"budget_update_interval": True}, "budget_update_interval"),
    ({"budget_threshold": 0.0}, "budget_threshold"),
    ({"budget_threshold": 1.5}, "budget_threshold"),
    ({"budget_threshold": "0.3"}, "budget_threshold"),
    ({"min_verify_tokens": -1}, "min_verify_tokens"),
])
def test_bad_params_raise_naming_the_field(params: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"method_params.{field}="):
        DynamicSpecParams(**params)
    with pytest.raises(ValueError, match=f"method_params.{field}="):
        DynamicSpecParams.from_dict(params)


def test_from_dict() -> None:
    assert DynamicSpecParams.from_dict(None) == DynamicSpecParams()
    assert DynamicSpecParams.from_dict({"budget_threshold": 0.7, "budget_update_interval": 50}) == \
        DynamicSpecParams(budget_update_interval=50, budget_threshold=0.7)
    with pytest.raises(ValueError, match=r"unknown keys \['budget'\]"):
        DynamicSpecParams.from_dict({"budget": 3})
    with pytest.raises(ValueError, match="must be a dict"):
        DynamicSpecParams.from_dict([("budget_threshold", 0.5)])  # type: ignore[arg-type]


def test_bad_scheduler_arguments_raise() -> None:
    with pytest.raises(ValueError, match="min_verify_tokens=5 must be <= num_speculative_tokens=4"):
        _scheduler(4, min_verify_tokens=5)
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        _scheduler(0)
    scheduler = _scheduler(4)
    with pytest.raises(ValueError, match="num_speculative_tokens=4"):
        scheduler.verify_lengths(torch.ones(2, 3))
    with pytest.raises(ValueError, match="floating-point"):
        scheduler.verify_lengths(torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="seed_token_ids"):
        markov_corrected_drafts(torch.zeros(2, 3, 5), torch.zeros(3, dtype=torch.int64), torch.zeros(5, 2),
                                torch.zeros(2, 5))
    with pytest.raises(ValueError, match="w2"):
        markov_corrected_drafts(torch.zeros(2, 3, 5), torch.zeros(2, dtype=torch.int64), torch.zeros(5, 2),
                                torch.zeros(3, 5))
