"""Penalties against a hand-written reference; min_tokens masks EOS and stop ids until reached."""
from __future__ import annotations

import pytest
import torch

from pagedserve.sample.penalties import apply_penalties
from pagedserve.sampling_params import SamplingParams


def reference_penalties(logits: list[float], prompt: list[int], output: list[int], presence: float,
                        frequency: float, repetition: float) -> list[float]:
    result = []
    for token, logit in enumerate(logits):
        if token in prompt or token in output:
            logit = logit / repetition if logit > 0 else logit * repetition
        logit -= frequency * output.count(token)
        logit -= presence * (1.0 if token in output else 0.0)
        result.append(logit)
    return result


ROWS = [
    # logits, prompt, output, presence, frequency, repetition
    ([2.0, -1.0, 0.5, -3.0, 1.0, 0.0, 0.7], [0, 3], [2, 2, 4], 0.25, 0.5, 2.0),
    ([1.0, 1.0, -0.5, 0.3, 0.0, -2.0, 4.0], [5, 5, 6], [], 1.0, 1.0, 1.5),
    ([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7], [], [6, 6, 6, 1], -0.5, 0.3, 1.0),
    ([3.0, -3.0, 0.0, 1.5, -0.2, 2.2, 0.9], [1, 2, 4], [0, 1], 0.0, 0.0, 0.8),
    ([0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5], [0, 1, 2], [3, 4], 0.0, 0.0, 1.0),  # no penalty at all
]


def test_penalties_match_reference(make_metadata) -> None:
    params = [SamplingParams(presence_penalty=presence, frequency_penalty=frequency,
                             repetition_penalty=repetition)
              for _, _, _, presence, frequency, repetition in ROWS]
    metadata = make_metadata(params, 7, [row[1] for row in ROWS], [row[2] for row in ROWS])
    logits = torch.tensor([row[0] for row in ROWS])
    original = logits.clone()
    penalised = apply_penalties(logits, metadata.prompt_token_ids, metadata.output_token_ids,
                                metadata.presence_penalties, metadata.frequency_penalties,
                                metadata.repetition_penalties)
    expected = torch.tensor([reference_penalties(*row) for row in ROWS])
    torch.testing.assert_close(penalised, expected)
    assert torch.equal(logits, original)
    # Rows without a penalty carry no history: only padding (vocab_size) in their token rows.
    assert torch.all(metadata.prompt_token_ids[4] == 7) and torch.all(metadata.output_token_ids[4] == 7)


def test_penalties_change_greedy_choice(sample) -> None:
    logits = torch.tensor([[3.0, 2.9, 1.0, 0.5]] * 3)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2),
              SamplingParams(temperature=0.0, frequency_penalty=0.05),
              SamplingParams(temperature=0.0)]
    output = sample(logits, params, prompt_token_ids=[[0], [1], [0]], output_token_ids=[[], [0, 0, 0], [0]])
    # Row 0: 3.0 / 1.2 = 2.5 < 2.9. Row 1: 3.0 - 0.15 = 2.85 < 2.9. Row 2: no penalty.
    assert output.sampled_token_ids.tolist() == [1, 1, 0]


def test_metadata_builds_no_penalty_tensors_when_unused(make_metadata) -> None:
    metadata = make_metadata([SamplingParams(), SamplingParams(temperature=0.0)], 10, [[1, 2], [3]], [[4], []])
    assert metadata.no_penalties
    assert metadata.prompt_token_ids is None and metadata.output_token_ids is None
    assert metadata.presence_penalties is None


def test_out_of_vocab_history_rejected(make_metadata) -> None:
    with pytest.raises(ValueError, match="prompt_token_ids"):
        make_metadata([SamplingParams(presence_penalty=0.5)], 10, [[1, 10]], [[]])


EOS_ID = 2


def eos_params(**keywords: object) -> SamplingParams:
    params = SamplingParams(temperature=0.0, **keywords)
    params.all_stop_token_ids = {EOS_ID}  # set by the engine from the tokenizer
    return params


def test_min_tokens_masks_eos_and_stop_ids_until_reached(sample) -> None:
    # EOS is the argmax, then stop id 4, then 1.
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.5, 3.0]] * 4)
    params = [eos_params(min_tokens=3, stop_token_ids=[4])] * 3 + [eos_params(stop_token_ids=[4])]
    output = sample(logits, params, output_token_ids=[[], [1, 1], [1, 1, 1], []])
    # Rows 0 and 1 are below min_tokens: EOS and 4 are masked; row 2 has reached it; row 3 has none.
    assert output.sampled_token_ids.tolist() == [1, 1, EOS_ID, EOS_ID]


def test_min_tokens_masks_for_random_rows_and_ignores_out_of_vocab_ids(sample) -> None:
    logits = torch.tensor([[0.0, 0.0, 8.0, 0.0, 8.0]] * 2000)
    params = [SamplingParams(min_tokens=1, stop_token_ids=[4, 99])] * 2000
    for row_params in params:
        row_params.all_stop_token_ids = {EOS_ID}
    torch.manual_seed(0)
    sampled = sample(logits, params).sampled_token_ids
    assert not torch.isin(sampled, torch.tensor([EOS_ID, 4])).any()
    assert set(sampled.tolist()) == {0, 1, 3}


def test_min_tokens_metadata_pairs(make_metadata) -> None:
    metadata = make_metadata([eos_params(min_tokens=2, stop_token_ids=[7, 3]), eos_params(min_tokens=2)],
                             10, output_token_ids=[[5], [5, 6]])
    assert metadata.min_tokens_row_ids.tolist() == [0, 0, 0]
    assert metadata.min_tokens_token_ids.tolist() == [EOS_ID, 3, 7]
    assert make_metadata([eos_params()], 10).min_tokens_row_ids is None
