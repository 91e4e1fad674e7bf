"""Raw logprobs, top-N and ranks of sampled tokens; prompt logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from pagedserve.core.scheduler_output import LogprobsLists
from pagedserve.sample import compute_prompt_logprobs
from pagedserve.sampling_params import SamplingParams


def log_softmax(values: list[float]) -> list[float]:
    total = math.log(sum(math.exp(value) for value in values))
    return [value - total for value in values]


def test_logprobs_are_raw_with_strict_ranks(sample) -> None:
    raw = [1.0, 3.0, 3.0, 0.5, 2.0]
    logits = torch.tensor([raw, raw, [1.0, 1.0, 1.0, -1.0, -2.0]])
    params = [SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[1, 2], logprobs=2),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=3)]
    output = sample(logits, params, prompt_token_ids=[[], [], [0, 1]])
    # Row 0: tokens 1 and 2 are masked by min_tokens, so greedy takes token 4; its logprob and rank
    # are still those of the raw logits (two tokens strictly more likely -> rank 3).
    # Row 1: token 1 ties with token 2; argmax takes 1, and nobody is strictly greater -> rank 1.
    # Row 2: repetition penalty is ignored by raw logprobs; greedy picks 2; rank 1 (ties with 0, 1).
    assert output.sampled_token_ids.tolist() == [4, 1, 2]
    tensors = output.logprobs
    assert tensors.logprob_token_ids.shape == (3, 4) and tensors.logprobs.shape == (3, 4)
    assert tensors.logprob_token_ids.dtype == torch.int64 and tensors.logprobs.dtype == torch.float32
    assert tensors.sampled_token_ranks.tolist() == [3, 1, 1]
    for row in range(3):
        expected = log_softmax(logits[row].tolist())
        token_ids = tensors.logprob_token_ids[row].tolist()
        assert token_ids[0] == output.sampled_token_ids[row]
        for column, token in enumerate(token_ids):
            assert tensors.logprobs[row, column].item() == pytest.approx(expected[token], abs=1e-6)
        top = tensors.logprobs[row, 1:].tolist()
        assert top == sorted(top, reverse=True)
        assert top[0] == pytest.approx(max(expected), abs=1e-6)
    assert tensors.logprob_token_ids[0, 1:3].tolist() in ([1, 2], [2, 1])
    assert tensors.logprob_token_ids[0, 3].item() == 4


def test_logprobs_of_random_rows_and_per_row_lists(sample) -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 40, generator=generator) * 2
    params = [SamplingParams(temperature=0.7, top_k=10, logprobs=5), SamplingParams(),
              SamplingParams(temperature=0.0, logprobs=1), SamplingParams(top_p=0.5, logprobs=0),
              SamplingParams(min_p=0.3, logprobs=3)]
    output = sample(logits, params)
    raw = torch.log_softmax(logits, dim=-1)
    tensors = output.logprobs
    assert tensors.max_num_logprobs == 5
    sampled = output.sampled_token_ids
    torch.testing.assert_close(tensors.logprobs[:, 0], raw.gather(1, sampled.unsqueeze(1)).squeeze(1))
    expected_ranks = (raw > raw.gather(1, sampled.unsqueeze(1))).sum(dim=1) + 1
    assert torch.equal(tensors.sampled_token_ranks, expected_ranks)
    torch.testing.assert_close(tensors.logprobs[:, 1:], raw.topk(5, dim=-1).values)

    per_row = tensors.to_lists_per_row([p.logprobs for p in params])
    assert per_row[1] is None
    assert isinstance(per_row[0], LogprobsLists)
    assert [len(lists.logprob_token_ids[0]) for lists in per_row if lists is not None] == [6, 2, 1, 4]
    assert per_row[3].logprob_token_ids == [[int(sampled[3])]]
    assert per_row[4].sampled_token_ranks == [int(expected_ranks[4])]
    everything = tensors.to_lists()
    assert everything.logprob_token_ids[4][:4] == per_row[4].logprob_token_ids[0]
    with pytest.raises(ValueError, match="num_logprobs_per_row"):
        tensors.to_lists_per_row([1, 2])
    with pytest.raises(ValueError, match="num_logprobs_per_row\\[0\\]=6"):
        tensors.to_lists_per_row([6, None, None, None, None])
    # LogprobsLists.slice: the runner's per-request cut of one host copy.
    assert everything.slice(0, 5) == per_row[0] and everything.slice(3, 0) == per_row[3]
    with pytest.raises(ValueError, match="num_logprobs=6"):
        everything.slice(0, 6)
    with pytest.raises(ValueError, match="row=5"):
        everything.slice(5, 1)


def test_no_logprobs_when_nobody_asks(sample) -> None:
    assert sample(torch.randn(2, 10), [SamplingParams(), SamplingParams(temperature=0.0)]).logprobs is None


def test_prompt_logprobs() -> None:
    prompt = [4, 1, 7, 7, 0, 3]
    logits = torch.randn(len(prompt) - 1, 8, generator=torch.Generator().manual_seed(4))
    logits[2, 7] = logits[2].max() + 1.0  # position 2 predicts token 7 as its top choice
    tensors = compute_prompt_logprobs(logits, prompt[1:], num_logprobs=3)
    raw = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(prompt[1:])
    assert tensors.logprob_token_ids[:, 0].tolist() == prompt[1:]
    torch.testing.assert_close(tensors.logprobs[:, 0], raw.gather(1, targets.unsqueeze(1)).squeeze(1))
    assert tensors.sampled_token_ranks[2].item() == 1
    assert torch.equal(tensors.sampled_token_ranks,
                       (raw > raw.gather(1, targets.unsqueeze(1))).sum(dim=1) + 1)
    assert torch.equal(tensors.logprob_token_ids[:, 1:], raw.topk(3, dim=-1).indices)
    # Tensor targets and num_logprobs=0 work too.
    assert compute_prompt_logprobs(logits, targets, 0).logprobs.shape == (5, 1)


def test_prompt_logprobs_bad_input() -> None:
    logits = torch.randn(4, 8)
    with pytest.raises(ValueError, match="target_token_ids.shape"):
        compute_prompt_logprobs(logits, [1, 2, 3], 2)
    with pytest.raises(ValueError, match="num_logprobs=9"):
        compute_prompt_logprobs(logits, [1, 2, 3, 4], 9)
    with pytest.raises(ValueError, match="target_token_ids contains 8"):
        compute_prompt_logprobs(logits, [1, 2, 3, 8], 2)
    with pytest.raises(ValueError, match="logits.shape"):
        compute_prompt_logprobs(torch.randn(8), [1], 2)
