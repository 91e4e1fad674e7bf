"""Greedy rows are the exact argmax; seeded rows are reproducible wherever they sit in a batch."""
from __future__ import annotations

import torch

from pagedserve.sampling_params import SamplingParams


def test_all_greedy_equals_argmax(sample) -> None:
    logits = torch.randn(256, 1000, generator=torch.Generator().manual_seed(0))
    output = sample(logits, [SamplingParams(temperature=0.0)] * 256)
    assert output.sampled_token_ids.dtype == torch.int64
    assert torch.equal(output.sampled_token_ids, logits.argmax(dim=-1))
    assert output.logprobs is None


def test_greedy_rows_in_mixed_batch_are_argmax_and_input_untouched(sample) -> None:
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(1))
    original = logits.clone()
    params = [SamplingParams(temperature=0.0) if row % 2 == 0 else
              SamplingParams(temperature=1.5, top_k=50, top_p=0.9, min_p=0.01) for row in range(8)]
    expected = logits.argmax(dim=-1)
    for global_seed in range(3):
        torch.manual_seed(global_seed)
        sampled = sample(logits, params).sampled_token_ids
        assert torch.equal(sampled[0::2], expected[0::2])
    assert torch.equal(logits, original)


def test_greedy_ignores_global_rng_state(sample) -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0)] * 4
    torch.manual_seed(0)
    first = sample(logits, params).sampled_token_ids
    torch.manual_seed(123)
    assert torch.equal(sample(logits, params).sampled_token_ids, first)


def _seeded_sequence(sample, logits_steps: list[torch.Tensor], seed: int, row: int,
                     batch_params: list[SamplingParams]) -> list[int]:
    """Sample a seeded request at `row` of a batch, over several steps with one generator."""
    generator = torch.Generator().manual_seed(seed)
    params = list(batch_params)
    params[row] = SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
    generators: list[torch.Generator | None] = [None] * len(params)
    generators[row] = generator
    tokens = []
    for step_logits in logits_steps:
        batch_logits = torch.randn(len(params), step_logits.shape[0])
        batch_logits[row] = step_logits
        tokens.append(int(sample(batch_logits, params, generators=generators).sampled_token_ids[row]))
    return tokens


def test_same_seed_same_tokens_alone_and_in_batch(sample) -> None:
    vocab_size = 64
    steps = [torch.randn(vocab_size, generator=torch.Generator().manual_seed(10 + step)) * 0.3
             for step in range(12)]
    torch.manual_seed(5)
    alone = _seeded_sequence(sample, steps, seed=42, row=0, batch_params=[SamplingParams()])
    other_seeded = SamplingParams(seed=7, temperature=1.3)
    batch = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=5), other_seeded,
             SamplingParams(min_p=0.1)]
    generator_for_other = torch.Generator().manual_seed(7)

    torch.manual_seed(99)  # a different global RNG state must not matter either
    generator = torch.Generator().manual_seed(42)
    in_batch = []
    for step_logits in steps:
        batch_logits = torch.randn(len(batch) + 1, vocab_size)
        batch_logits[2] = step_logits
        params = batch[:2] + [SamplingParams(temperature=0.8, top_p=0.95, seed=42)] + batch[2:]
        generators = [None, None, generator, None, generator_for_other, None]
        in_batch.append(int(sample(batch_logits, params, generators=generators).sampled_token_ids[2]))
    assert in_batch == alone
    # A different seed gives a different sequence (12 near-uniform draws over 64 tokens).
    assert _seeded_sequence(sample, steps, seed=43, row=0, batch_params=[SamplingParams()]) != alone
