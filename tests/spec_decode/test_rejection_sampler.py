"""RejectionSampler (pagedserve/spec_decode/rejection_sampler.py): losslessness, greedy parity, reproducibility.

The distribution tests run 100,000 verifications of a vocab-6, 3-draft toy model in one call (rows are trials)
whose target and drafter distributions depend on the whole drafted prefix, and compare the emitted tokens with
the target's joint law by chi-square at a fixed significance (fixed seeds: deterministic). Rows that emit fewer
tokens than a test looks at are continued by sampling the true target, which is what the next engine step does;
comparing only rows that happened to emit enough tokens would be biased.

A plain scalar reference, one row at a time with Python loops, pins the vectorised sampler down on ragged batches
(0 drafts, full drafts, placeholder drafts, greedy and random rows, with and without draft probabilities), drawing
the same randomness from clones of each row's generator.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import pytest
import torch

from chi_square import chi_square_critical_value
from pagedserve.sample.sampler import random_sample
from pagedserve.sample.sampling_metadata import build_sampling_metadata
from pagedserve.sampling_params import SamplingParams
from pagedserve.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler

# The toy model of the distribution tests.
VOCAB_SIZE = 6
NUM_SPECULATIVE_TOKENS = 3
NUM_TRIALS = 100_000
# Significance of every goodness-of-fit test; cells expected fewer times than this are pooled into one.
MIN_EXPECTED_COUNT = 5.0

MODES = {
    "standard": dict(),
    "block": dict(enable_block_verify=True),
    "entropy": dict(enable_entropy_verify=True),
    "block_entropy": dict(enable_block_verify=True, enable_entropy_verify=True),
}


# ---- the scalar reference -------------------------------------------------------------------------------------
@dataclass
class ReferenceRow:
    """One row's inputs: drafts (its num_draft_tokens entries), [n + 1, V] target logits, [n, V] draft probs or
    None, [n + 1, V] raw logits or None."""

    draft_token_ids: list[int]
    target_logits: torch.Tensor
    draft_probs: torch.Tensor | None
    is_greedy: bool
    raw_target_logits: torch.Tensor | None = None


def first_index_of_maximum(values: list[float]) -> int:
    return values.index(max(values))


def reference_verify(sampler: RejectionSampler, row: ReferenceRow, generator: torch.Generator | None) -> list[int]:
    """The emitted tokens of one row, written plainly (float64 arithmetic on the float32 softmax)."""
    drafts = row.draft_token_ids
    num_drafts = len(drafts)
    vocab_size = row.target_logits.shape[-1]
    if row.is_greedy:
        emitted = []
        for position in range(num_drafts + 1):
            target_token = int(row.target_logits[position].max(dim=-1).indices)
            emitted.append(target_token)
            if position == num_drafts or drafts[position] != target_token:
                return emitted
    assert generator is not None, "the reference draws random rows' randomness from their generator"
    noise = torch.empty(vocab_size).uniform_(generator=generator).log_().neg_().tolist()
    uniforms = torch.empty(num_drafts).uniform_(generator=generator).tolist()
    target = [row.target_logits[position].softmax(dim=-1).double().tolist() for position in range(num_drafts + 1)]

    def draft_distribution(position: int) -> list[float]:
        if position >= num_drafts or drafts[position] == PLACEHOLDER_TOKEN_ID:
            return [0.0] * vocab_size
        if row.draft_probs is None:
            return [1.0 if token == drafts[position] else 0.0 for token in range(vocab_size)]
        return row.draft_probs[position].double().tolist()

    def ratio(position: int) -> float:
        token = drafts[position]
        draft_mass = draft_distribution(position)[token] if token != PLACEHOLDER_TOKEN_ID else 0.0
        return target[position][token] / draft_mass if draft_mass > 0 else 0.0

    thresholds = [1.0] * num_drafts
    if sampler.enable_entropy_verify:
        assert row.raw_target_logits is not None
        for position in range(num_drafts):
            probs = row.raw_target_logits[position].softmax(dim=-1).double().tolist()
            entropy = -sum(probability * math.log(probability + 1e-10) for probability in probs)
            thresholds[position] = min(math.exp(-sampler.posterior_alpha * entropy), sampler.posterior_threshold)

    if not sampler.enable_block_verify:
        num_accepted = 0
        while num_accepted < num_drafts and uniforms[num_accepted] * thresholds[num_accepted] < ratio(num_accepted):
            num_accepted += 1
        weight = 1.0
    else:
        weights = [1.0]
        for position in range(num_drafts):
            weights.append(min(weights[-1] * ratio(position), 1.0))
        num_accepted = 0
        for kept in range(1, num_drafts + 1):
            if kept < num_drafts:
                draft = draft_distribution(kept)
                residual_mass = sum(max(weights[kept] * target[kept][token] - draft[token], 0.0)
                                    for token in range(vocab_size))
                denominator = residual_mass + 1.0 - weights[kept]
                keep_probability = residual_mass / denominator if denominator > 0 else 0.0
            else:
                keep_probability = weights[num_drafts]
            if uniforms[kept - 1] * thresholds[kept - 1] < keep_probability:
                num_accepted = kept
        weight = weights[num_accepted]

    draft = draft_distribution(num_accepted)
    residual = [max(weight * target[num_accepted][token] - draft[token], 0.0) for token in range(vocab_size)]
    if sum(residual) <= 0:
        residual = target[num_accepted]
    token = first_index_of_maximum([residual[token] / noise[token] for token in range(vocab_size)])
    return drafts[:num_accepted] + [token]


def clone_generator(generator: torch.Generator) -> torch.Generator:
    clone = torch.Generator()
    clone.set_state(generator.get_state())
    return clone


def ragged_batch(generator: torch.Generator, num_rows: int, max_num_draft_tokens: int, vocab_size: int,
                 with_draft_probs: bool) -> dict:
    """Random sampler inputs: ragged drafts (rows 0 and 1 with none and all), placeholder drafts, masked target
    tokens, zero draft probabilities, mixed greedy rows; positions past the drafts hold NaN."""
    num_draft_tokens = torch.randint(0, max_num_draft_tokens + 1, (num_rows,), generator=generator).tolist()
    num_draft_tokens[0], num_draft_tokens[1] = 0, max_num_draft_tokens
    shape = (num_rows, max_num_draft_tokens + 1, vocab_size)
    draft_logits = 2.0 * torch.randn(shape, generator=generator)
    # The target resembles the drafter (so drafts get accepted), with some tokens masked as top-k would.
    target_logits = draft_logits + torch.randn(shape, generator=generator)
    target_logits[torch.rand(shape, generator=generator) < 0.15] = -math.inf
    target_logits[..., 0] = target_logits[..., 0].nan_to_num(neginf=0.0)  # never an all-masked position
    draft_probs = draft_logits[:, :max_num_draft_tokens].softmax(dim=-1)
    draft_probs[torch.rand(draft_probs.shape, generator=generator) < 0.1] = 0.0
    draft_probs = draft_probs / draft_probs.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    is_greedy = torch.rand(num_rows, generator=generator) < 0.3
    # Unprocessed logits (entropy verify): a different scale than the processed ones, nothing masked.
    raw_target_logits = 1.5 * target_logits.nan_to_num(neginf=-5.0)
    draft_token_ids = torch.full((num_rows, max_num_draft_tokens), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    for row, count in enumerate(num_draft_tokens):
        for position in range(count):
            if bool(is_greedy[row]) and float(torch.rand(1, generator=generator)) < 0.7:
                draft = int(target_logits[row, position].max(dim=-1).indices)
            elif float(torch.rand(1, generator=generator)) < 0.1:
                draft = PLACEHOLDER_TOKEN_ID
            else:
                draft = int(torch.multinomial(draft_probs[row, position].clamp_min(1e-6), 1, generator=generator))
            draft_token_ids[row, position] = draft
        # Positions past the row's drafts are garbage the sampler must ignore.
        target_logits[row, count + 1:] = math.nan
        raw_target_logits[row, count + 1:] = math.nan
        draft_probs[row, count:] = math.nan
    return dict(draft_token_ids=draft_token_ids, num_draft_tokens=num_draft_tokens, target_logits=target_logits,
                draft_probs=draft_probs if with_draft_probs else None, is_greedy=is_greedy,
                raw_target_logits=raw_target_logits)


def reference_row(batch: dict, row: int) -> ReferenceRow:
    count = batch["num_draft_tokens"][row]
    draft_probs = batch["draft_probs"]
    return ReferenceRow(draft_token_ids=batch["draft_token_ids"][row, :count].tolist(),
                        target_logits=batch["target_logits"][row, :count + 1],
                        draft_probs=None if draft_probs is None else draft_probs[row, :count],
                        is_greedy=bool(batch["is_greedy"][row]),
                        raw_target_logits=batch["raw_target_logits"][row, :count + 1])


def assert_row_emits(output_token_ids: torch.Tensor, num_accepted_tokens: list[int], row: int,
                     expected: list[int]) -> None:
    emitted = output_token_ids[row].tolist()
    assert num_accepted_tokens[row] == len(expected) - 1, (row, emitted, expected)
    assert emitted[:len(expected)] == expected, (row, emitted, expected)
    assert all(token == PLACEHOLDER_TOKEN_ID for token in emitted[len(expected):]), (row, emitted)


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("mode", list(MODES))
def test_vectorised_matches_scalar_reference(mode: str, with_draft_probs: bool) -> None:
    sampler = RejectionSampler(**MODES[mode])
    inputs_generator = torch.Generator().manual_seed(sum(map(ord, mode)) + with_draft_probs)
    num_compared = 0
    for trial in range(4):
        batch = ragged_batch(inputs_generator, num_rows=24, max_num_draft_tokens=4, vocab_size=9,
                             with_draft_probs=with_draft_probs)
        # Every random row seeded, so that the reference can draw the same numbers from a clone.
        generators = {row: torch.Generator().manual_seed(1000 * trial + row)
                      for row in range(len(batch["num_draft_tokens"])) if not bool(batch["is_greedy"][row])}
        clones = {row: clone_generator(generator) for row, generator in generators.items()}
        output = sampler(generators=generators, **batch)
        for row in range(len(batch["num_draft_tokens"])):
            expected = reference_verify(sampler, reference_row(batch, row), clones.get(row))
            assert_row_emits(output.output_token_ids, output.num_accepted_tokens, row, expected)
            num_compared += 1
        # Each seeded row consumed exactly its noise and its uniforms, as the reference did.
        for row, generator in generators.items():
            assert torch.equal(generator.get_state(), clones[row].get_state()), row
    assert num_compared == 96


# ---- the toy model of the distribution tests ------------------------------------------------------------------
def prefix_offset(length: int) -> int:
    """Index of the first prefix of this length in the tables (all shorter prefixes come first)."""
    return sum(VOCAB_SIZE ** shorter for shorter in range(length))


def child_index(parent_index: torch.Tensor, token_ids: torch.Tensor, parent_length: int) -> torch.Tensor:
    return prefix_offset(parent_length + 1) + (parent_index - prefix_offset(parent_length)) * VOCAB_SIZE + token_ids


@lru_cache(maxsize=None)
def prefix_tables(seed: int, target_scale: float, draft_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(target, drafter) [num_prefixes, V] float64 next-token laws for every prefix of 0..K tokens. Some target
    tokens are masked (as top-k would) and some drafter tokens get no mass, so ratios 0 and > 1 both occur."""
    generator = torch.Generator().manual_seed(seed)
    num_prefixes = prefix_offset(NUM_SPECULATIVE_TOKENS + 1)
    target = (target_scale * torch.randn(num_prefixes, VOCAB_SIZE, generator=generator, dtype=torch.float64))
    target[torch.rand(num_prefixes, VOCAB_SIZE, generator=generator) < 0.15] = -math.inf
    target[:, 2] = target[:, 2].nan_to_num(neginf=0.0)
    draft = (draft_scale * torch.randn(num_prefixes, VOCAB_SIZE, generator=generator, dtype=torch.float64))
    draft[torch.rand(num_prefixes, VOCAB_SIZE, generator=generator) < 0.15] = -math.inf
    draft[:, 3] = draft[:, 3].nan_to_num(neginf=0.0)
    return target.softmax(dim=-1), draft.softmax(dim=-1)


@lru_cache(maxsize=None)
def toy_batch(seed: int, target_scale: float, draft_scale: float) -> dict:
    """NUM_TRIALS rows, each with K drafts sampled from the drafter along its own prefix."""
    target_table, draft_table = prefix_tables(seed, target_scale, draft_scale)
    generator = torch.Generator().manual_seed(seed + 1)
    shape = (NUM_TRIALS, NUM_SPECULATIVE_TOKENS + 1, VOCAB_SIZE)
    target_logits = torch.empty(shape, dtype=torch.float32)
    draft_probs = torch.empty((NUM_TRIALS, NUM_SPECULATIVE_TOKENS, VOCAB_SIZE), dtype=torch.float32)
    draft_token_ids = torch.empty((NUM_TRIALS, NUM_SPECULATIVE_TOKENS), dtype=torch.int64)
    prefix_indices = torch.zeros(NUM_TRIALS, dtype=torch.int64)
    for position in range(NUM_SPECULATIVE_TOKENS + 1):
        target_logits[:, position] = target_table[prefix_indices].log().float()
        if position == NUM_SPECULATIVE_TOKENS:
            break
        draft_probs[:, position] = draft_table[prefix_indices].float()
        draft_token_ids[:, position] = torch.multinomial(draft_table[prefix_indices], 1, generator=generator)[:, 0]
        prefix_indices = child_index(prefix_indices, draft_token_ids[:, position], position)
    return dict(draft_token_ids=draft_token_ids, num_draft_tokens=[NUM_SPECULATIVE_TOKENS] * NUM_TRIALS,
                target_logits=target_logits, draft_probs=draft_probs,
                is_greedy=torch.zeros(NUM_TRIALS, dtype=torch.bool), raw_target_logits=target_logits)


def continue_with_target(output_token_ids: torch.Tensor, num_accepted_tokens: list[int], length: int,
                         target_table: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[rows, length]: each row's emitted tokens, continued by sampling the target where it emitted fewer."""
    tokens = output_token_ids[:, :length].clone()
    num_emitted = torch.tensor(num_accepted_tokens) + 1
    prefix_indices = torch.zeros(tokens.shape[0], dtype=torch.int64)
    for position in range(length):
        is_missing = num_emitted <= position
        laws = target_table[prefix_indices[is_missing]]
        tokens[is_missing, position] = torch.multinomial(laws, 1, generator=generator)[:, 0]
        prefix_indices = child_index(prefix_indices, tokens[:, position], position)
    return tokens


def target_joint_law(target_table: torch.Tensor, length: int) -> list[float]:
    """P(first `length` tokens = s) for every s in lexicographic order."""
    law = []
    for sequence in itertools.product(range(VOCAB_SIZE), repeat=length):
        probability, prefix_index = 1.0, 0
        for position, token in enumerate(sequence):
            probability *= float(target_table[prefix_index, token])
            prefix_index = int(child_index(torch.tensor(prefix_index), torch.tensor(token), position))
        law.append(probability)
    return law


def chi_square_against(tokens: torch.Tensor, law: list[float]) -> tuple[float, float]:
    """(statistic, critical value) of the rows' token sequences ([rows, length]) against `law` over V^length.

    Sequences the law forbids must never occur; cells expected < MIN_EXPECTED_COUNT times are pooled into one."""
    length = tokens.shape[1]
    codes = torch.zeros(tokens.shape[0], dtype=torch.int64)
    for position in range(length):
        codes = codes * VOCAB_SIZE + tokens[:, position]
    counts = torch.bincount(codes, minlength=VOCAB_SIZE ** length).tolist()
    forbidden = [cell for cell, probability in enumerate(law) if probability == 0 and counts[cell] > 0]
    assert not forbidden, f"sequences the target cannot produce were emitted: {forbidden}"
    observed, expected, pooled_observed, pooled_expected = [], [], 0, 0.0
    for count, probability in zip(counts, law):
        if probability * len(codes) >= MIN_EXPECTED_COUNT:
            observed.append(count)
            expected.append(probability * len(codes))
        elif probability > 0:
            pooled_observed += count
            pooled_expected += probability * len(codes)
    if pooled_expected > 0:
        observed.append(pooled_observed)
        expected.append(pooled_expected)
    statistic = sum((seen - wanted) ** 2 / wanted for seen, wanted in zip(observed, expected))
    return statistic, chi_square_critical_value(len(observed) - 1)


LOSSLESS_TABLES = (7, 1.2, 1.5)  # seed, target and drafter logit scales: moderate acceptance (~55% per draft)


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("mode", ["standard", "block"])
def test_emitted_tokens_follow_the_target(mode: str, with_draft_probs: bool) -> None:
    """First token ~ p(.), first two ~ p(y1) p(y2 | y1), first three likewise, with drafts from a prefix-dependent
    drafter (one_hot: the same drafts verified as if the drafter gave no probabilities)."""
    target_table, _ = prefix_tables(*LOSSLESS_TABLES)
    batch = dict(toy_batch(*LOSSLESS_TABLES))
    if not with_draft_probs:
        batch["draft_probs"] = None
    torch.manual_seed(11)
    output = RejectionSampler(**MODES[mode])(generators={}, **batch)
    tokens = continue_with_target(output.output_token_ids, output.num_accepted_tokens, 3, target_table,
                                  torch.Generator().manual_seed(12))
    for length in (1, 2, 3):
        statistic, critical = chi_square_against(tokens[:, :length], target_joint_law(target_table, length))
        assert statistic < critical, (mode, with_draft_probs, length, statistic, critical)


def exact_mean_accepted(mode: str) -> float:
    """E[accepted drafts] of the toy model by enumeration: standard sums P(all of x_1..x_i pass) =
    prod min(ratio, 1); block sums P(tau >= i) = w_i (the module docstring's invariant)."""
    target_table, draft_table = prefix_tables(*LOSSLESS_TABLES)
    mean = 0.0
    for drafts in itertools.product(range(VOCAB_SIZE), repeat=NUM_SPECULATIVE_TOKENS):
        # Over whole draft blocks: P(block) * (P(at least 1 kept | block) + ... + P(all K kept | block)).
        probability, prefix_index, product, weight, num_kept = 1.0, 0, 1.0, 1.0, 0.0
        for position, token in enumerate(drafts):
            draft_mass = float(draft_table[prefix_index, token])
            ratio = float(target_table[prefix_index, token]) / draft_mass if draft_mass > 0 else 0.0
            probability *= draft_mass
            product *= min(ratio, 1.0)
            weight = min(weight * ratio, 1.0)
            num_kept += weight if mode == "block" else product
            prefix_index = int(child_index(torch.tensor(prefix_index), torch.tensor(token), position))
        mean += probability * num_kept
    return mean


def test_block_verify_accepts_at_least_as_many_as_standard() -> None:
    """Same uniforms (same seed): block verify's mean accepted length beats standard's, and both match the
    exact expectations of the toy model within 5 standard errors."""
    batch = toy_batch(*LOSSLESS_TABLES)
    means = {}
    for mode in ("standard", "block"):
        torch.manual_seed(21)
        accepted = torch.tensor(RejectionSampler(**MODES[mode])(generators={}, **batch).num_accepted_tokens,
                                dtype=torch.float64)
        means[mode] = float(accepted.mean())
        standard_error = float(accepted.std()) / math.sqrt(NUM_TRIALS)
        assert abs(means[mode] - exact_mean_accepted(mode)) < 5 * standard_error, (mode, means[mode])
    assert exact_mean_accepted("block") > exact_mean_accepted("standard")
    assert means["block"] > means["standard"], means


@pytest.mark.parametrize("with_block", [False, True], ids=["standard", "block"])
def test_drafts_with_ratios_at_least_one_are_all_accepted(with_block: bool) -> None:
    """Drafts picked where p >= q: standard and block keep every draft and draw the same bonus token."""
    generator = torch.Generator().manual_seed(31)
    num_rows, max_num_draft_tokens, vocab_size = 64, 4, 11
    target_logits = torch.randn((num_rows, max_num_draft_tokens + 1, vocab_size), generator=generator)
    draft_probs = torch.randn((num_rows, max_num_draft_tokens, vocab_size), generator=generator).softmax(dim=-1)
    # argmax p/q >= 1 always (both sum to 1).
    draft_token_ids = (target_logits[:, :max_num_draft_tokens].softmax(dim=-1) / draft_probs).argmax(dim=-1)
    num_draft_tokens = torch.randint(0, max_num_draft_tokens + 1, (num_rows,), generator=generator).tolist()
    for row, count in enumerate(num_draft_tokens):
        draft_token_ids[row, count:] = PLACEHOLDER_TOKEN_ID
    outputs = []
    for enable_block_verify in (False, with_block):
        generators = {row: torch.Generator().manual_seed(row) for row in range(0, num_rows, 2)}
        torch.manual_seed(32)
        outputs.append(RejectionSampler(enable_block_verify=enable_block_verify)(
            draft_token_ids, num_draft_tokens, target_logits, draft_probs,
            torch.zeros(num_rows, dtype=torch.bool), generators))
    for output in outputs:
        assert output.num_accepted_tokens == num_draft_tokens
    assert torch.equal(outputs[0].output_token_ids, outputs[1].output_token_ids)


@pytest.mark.parametrize("mode", list(MODES))
def test_drafter_equal_to_target_accepts_everything(mode: str) -> None:
    generator = torch.Generator().manual_seed(41)
    num_rows, max_num_draft_tokens, vocab_size = 256, 5, 13
    target_logits = 2.0 * torch.randn((num_rows, max_num_draft_tokens + 1, vocab_size), generator=generator)
    # The very values the sampler computes (its softmax over all positions), so that every ratio is exactly 1.
    draft_probs = target_logits.softmax(dim=-1)[:, :max_num_draft_tokens]
    draft_token_ids = torch.multinomial(draft_probs.reshape(-1, vocab_size), 1, generator=generator)
    draft_token_ids = draft_token_ids.view(num_rows, max_num_draft_tokens)
    torch.manual_seed(42)
    output = RejectionSampler(**MODES[mode])(
        draft_token_ids, [max_num_draft_tokens] * num_rows, target_logits, draft_probs,
        torch.zeros(num_rows, dtype=torch.bool), {}, raw_target_logits=target_logits)
    assert output.num_accepted_tokens == [max_num_draft_tokens] * num_rows
    assert torch.equal(output.output_token_ids[:, :max_num_draft_tokens], draft_token_ids)


def test_entropy_verify_is_lossy() -> None:
    """On a near-uniform target with a peaked drafter, entropy verify (alpha 0.4) accepts far more drafts and its
    first token is measurably not distributed as the target's, while standard verify on the same rows is."""
    tables = (51, 0.3, 3.0)
    target_table, _ = prefix_tables(*tables)
    batch = toy_batch(*tables)
    law = target_joint_law(target_table, 1)
    results = {}
    for mode in ("standard", "entropy"):
        torch.manual_seed(52)
        output = RejectionSampler(**MODES[mode])(generators={}, **batch)
        statistic, critical = chi_square_against(output.output_token_ids[:, :1], law)
        results[mode] = (statistic, critical, sum(output.num_accepted_tokens) / NUM_TRIALS)
    assert results["standard"][0] < results["standard"][1], results
    assert results["entropy"][0] > 10 * results["entropy"][1], results
    assert results["entropy"][2] > results["standard"][2] + 0.2, results


# ---- greedy -------------------------------------------------------------------------------------------------------
def test_greedy_rows_match_non_speculative_argmax_and_draw_nothing() -> None:
    generator = torch.Generator().manual_seed(61)
    num_rows, max_num_draft_tokens, vocab_size = 48, 4, 40
    # Integer logits: ties are frequent, and the first maximum must win as in the sampler.
    target_logits = torch.randint(-3, 4, (num_rows, max_num_draft_tokens + 1, vocab_size), generator=generator)
    target_logits = target_logits.to(torch.float32)
    argmax = target_logits.max(dim=-1).indices
    draft_token_ids = torch.where(torch.rand((num_rows, max_num_draft_tokens), generator=generator) < 0.8,
                                  argmax[:, :max_num_draft_tokens],
                                  torch.randint(0, vocab_size, (num_rows, max_num_draft_tokens), generator=generator))
    num_draft_tokens = torch.randint(0, max_num_draft_tokens + 1, (num_rows,), generator=generator).tolist()
    draft_token_ids[3, 0] = PLACEHOLDER_TOKEN_ID
    num_draft_tokens[3] = max(num_draft_tokens[3], 1)
    for row, count in enumerate(num_draft_tokens):
        draft_token_ids[row, count:] = PLACEHOLDER_TOKEN_ID
    row_generators = {row: torch.Generator().manual_seed(row) for row in range(0, num_rows, 3)}
    generator_states = {row: row_generator.get_state() for row, row_generator in row_generators.items()}
    global_state = torch.get_rng_state()
    for mode in MODES:
        output = RejectionSampler(**MODES[mode])(
            draft_token_ids, num_draft_tokens, target_logits, None, torch.ones(num_rows, dtype=torch.bool),
            row_generators, raw_target_logits=target_logits)
        for row, count in enumerate(num_draft_tokens):
            # Non-speculative greedy decoding: the argmax at each position, up to the first draft that differs.
            expected = []
            for position in range(count + 1):
                expected.append(int(argmax[row, position]))
                if position == count or int(draft_token_ids[row, position]) != expected[-1]:
                    break
            assert_row_emits(output.output_token_ids, output.num_accepted_tokens, row, expected)
    assert torch.equal(torch.get_rng_state(), global_state)
    for row, row_generator in row_generators.items():
        assert torch.equal(row_generator.get_state(), generator_states[row])


# ---- randomness contract ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("mode", list(MODES))
def test_seeded_row_is_independent_of_the_batch(mode: str, with_draft_probs: bool) -> None:
    """A seeded row emits the same tokens alone (no padding) and inside a wider, padded batch of other rows."""
    sampler = RejectionSampler(**MODES[mode])
    batch = ragged_batch(torch.Generator().manual_seed(71), num_rows=6, max_num_draft_tokens=6, vocab_size=17,
                         with_draft_probs=with_draft_probs)
    batch["is_greedy"][:] = False
    batch["is_greedy"][1] = True
    # Row 2 has 4 of the batch's 6 draft positions; row 4 is seeded too, rows 0, 3 and 5 are not.
    row = 2
    count = batch["num_draft_tokens"][row]
    assert count == 4
    alone = reference_row(batch, row)
    for seed in range(8):
        in_batch_generators = {row: torch.Generator().manual_seed(seed), 4: torch.Generator().manual_seed(99)}
        torch.manual_seed(seed)
        in_batch = sampler(generators=in_batch_generators, **batch)
        alone_generator = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed + 1000)  # the global RNG must not matter
        by_itself = sampler(
            draft_token_ids=torch.tensor([alone.draft_token_ids]), num_draft_tokens=[count],
            target_logits=alone.target_logits.unsqueeze(0),
            draft_probs=None if alone.draft_probs is None else alone.draft_probs.unsqueeze(0),
            is_greedy=torch.tensor([False]), generators={0: alone_generator},
            raw_target_logits=alone.raw_target_logits.unsqueeze(0))
        emitted = by_itself.output_token_ids[0].tolist()[:by_itself.num_accepted_tokens[0] + 1]
        assert_row_emits(in_batch.output_token_ids, in_batch.num_accepted_tokens, row, emitted)
        assert torch.equal(alone_generator.get_state(), in_batch_generators[row].get_state())


@pytest.mark.parametrize("mode", list(MODES))
def test_row_without_drafts_samples_like_the_sampler(mode: str) -> None:
    """num_draft_tokens = 0: the same token random_sample draws from the same generator state (seeded rows) or
    the same global seed (unseeded rows)."""
    generator = torch.Generator().manual_seed(81)
    num_rows, max_num_draft_tokens, vocab_size = 16, 2, 1000
    target_logits = 3.0 * torch.randn((num_rows, max_num_draft_tokens + 1, vocab_size), generator=generator)
    draft_token_ids = torch.full((num_rows, max_num_draft_tokens), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    sampler = RejectionSampler(**MODES[mode])
    for seeded in (True, False):
        expected_generators = [torch.Generator().manual_seed(row) if seeded else None for row in range(num_rows)]
        metadata = build_sampling_metadata([SamplingParams(temperature=1.0, seed=row if seeded else None)
                                            for row in range(num_rows)], [[]] * num_rows, [[]] * num_rows,
                                           expected_generators, vocab_size, torch.device("cpu"))
        torch.manual_seed(82)
        expected = random_sample(target_logits[:, 0].softmax(dim=-1), metadata)
        generators = {row: torch.Generator().manual_seed(row) for row in range(num_rows)} if seeded else {}
        torch.manual_seed(82)
        output = sampler(draft_token_ids, [0] * num_rows, target_logits, None, torch.zeros(num_rows, dtype=torch.bool),
                         generators, raw_target_logits=target_logits)
        assert output.num_accepted_tokens == [0] * num_rows
        assert torch.equal(output.output_token_ids[:, 0], expected)


def test_unseeded_rows_follow_the_global_seed() -> None:
    batch = ragged_batch(torch.Generator().manual_seed(91), num_rows=32, max_num_draft_tokens=4, vocab_size=50,
                         with_draft_probs=True)
    sampler = RejectionSampler(enable_block_verify=True)
    outputs = []
    for _ in range(2):
        torch.manual_seed(92)
        outputs.append(sampler(generators={}, **batch).output_token_ids)
    assert torch.equal(outputs[0], outputs[1])


# ---- bad input ----------------------------------------------------------------------------------------------------
def small_inputs() -> dict:
    return dict(draft_token_ids=torch.tensor([[1, 2], [3, PLACEHOLDER_TOKEN_ID]]), num_draft_tokens=[2, 1],
                target_logits=torch.zeros(2, 3, 5), draft_probs=torch.full((2, 2, 5), 0.2),
                is_greedy=torch.tensor([False, True]), generators={}, raw_target_logits=torch.zeros(2, 3, 5))


BAD_INPUTS = {
    "draft_ids_1d": (dict(draft_token_ids=torch.tensor([1, 2])), "draft_token_ids.shape"),
    "draft_ids_int32": (dict(draft_token_ids=torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)), "draft_token_ids"),
    "too_few_counts": (dict(num_draft_tokens=[2]), "len\\(num_draft_tokens\\)=1"),
    "count_above_k": (dict(num_draft_tokens=[3, 1]), "num_draft_tokens\\[0\\]=3"),
    "negative_count": (dict(num_draft_tokens=[2, -1]), "num_draft_tokens\\[1\\]=-1"),
    "target_width": (dict(target_logits=torch.zeros(2, 2, 5)), "target_logits.shape=\\(2, 2, 5\\)"),
    "target_dtype": (dict(target_logits=torch.zeros(2, 3, 5, dtype=torch.bfloat16)), "target_logits"),
    "draft_probs_vocab": (dict(draft_probs=torch.zeros(2, 2, 4)), "draft_probs.shape=\\(2, 2, 4\\)"),
    "is_greedy_shape": (dict(is_greedy=torch.tensor([False])), "is_greedy.shape=\\(1,\\)"),
    "is_greedy_dtype": (dict(is_greedy=torch.tensor([0, 1])), "is_greedy"),
    "generator_row": (dict(generators={2: torch.Generator()}), "generators has row 2"),
    "token_out_of_vocab": (dict(draft_token_ids=torch.tensor([[1, 5], [3, PLACEHOLDER_TOKEN_ID]])),
                           "draft_token_ids\\[0, 1\\]=5"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_name_the_argument(case: str) -> None:
    change, message = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=message):
        RejectionSampler()(**{**small_inputs(), **change})


def test_entropy_verify_needs_raw_logits_and_valid_settings() -> None:
    with pytest.raises(ValueError, match="raw_target_logits=None"):
        RejectionSampler(enable_entropy_verify=True)(**{**small_inputs(), "raw_target_logits": None})
    with pytest.raises(ValueError, match="raw_target_logits.shape"):
        RejectionSampler(enable_entropy_verify=True)(**{**small_inputs(), "raw_target_logits": torch.zeros(2, 3, 4)})
    RejectionSampler()(**{**small_inputs(), "raw_target_logits": None})  # only entropy verify reads them
    for settings, message in ((dict(posterior_threshold=0.0), "posterior_threshold"),
                              (dict(posterior_threshold=1.5), "posterior_threshold"),
                              (dict(posterior_alpha=-0.1), "posterior_alpha")):
        with pytest.raises(ValueError, match=message):
            RejectionSampler(**settings)
