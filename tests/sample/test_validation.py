"""Bad shapes and inconsistent metadata inputs are rejected; fast-path flags are set right."""
from __future__ import annotations

import pytest
import torch

from pagedserve.sample import Sampler, build_sampling_metadata
from pagedserve.sampling_params import SamplingParams


@pytest.mark.parametrize("shape", [(3,), (2, 10), (3, 9), (3, 10, 1)])
def test_bad_logits_shape_rejected(shape: tuple[int, ...], make_metadata) -> None:
    metadata = make_metadata([SamplingParams()] * 3, 10)
    with pytest.raises(ValueError, match="logits.shape"):
        Sampler()(torch.randn(shape), metadata)


def test_integer_logits_rejected(make_metadata) -> None:
    with pytest.raises(ValueError, match="logits.dtype"):
        Sampler()(torch.zeros(1, 10, dtype=torch.int64), make_metadata([SamplingParams()], 10))


def test_half_precision_logits_accepted(make_metadata) -> None:
    logits = torch.randn(2, 10).to(torch.bfloat16)
    output = Sampler()(logits, make_metadata([SamplingParams(temperature=0.0, logprobs=2)] * 2, 10))
    assert torch.equal(output.sampled_token_ids, logits.float().argmax(dim=-1))
    assert output.logprobs.logprobs.dtype == torch.float32


def test_inconsistent_metadata_inputs_rejected() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="len\\(prompt_token_ids\\)=1"):
        build_sampling_metadata([SamplingParams()] * 2, [[]], [[], []], [None, None], 10, cpu)
    with pytest.raises(ValueError, match="len\\(generators\\)=3"):
        build_sampling_metadata([SamplingParams()] * 2, [[], []], [[], []], [None] * 3, 10, cpu)
    with pytest.raises(ValueError, match="vocab_size=0"):
        build_sampling_metadata([SamplingParams()], [[]], [[]], [None], 0, cpu)
    with pytest.raises(ValueError, match="generators\\[1\\]=None"):
        build_sampling_metadata([SamplingParams(), SamplingParams(seed=3)], [[], []], [[], []],
                                [None, None], 10, cpu)
    with pytest.raises(ValueError, match="logprobs=20 must be <= vocab_size=10"):
        build_sampling_metadata([SamplingParams(logprobs=20)], [[]], [[]], [None], 10, cpu)
    with pytest.raises(ValueError, match="params\\[0\\]"):
        build_sampling_metadata([{"temperature": 1.0}], [[]], [[]], [None], 10, cpu)


def test_fast_path_flags(make_metadata) -> None:
    greedy = make_metadata([SamplingParams(temperature=0.0, top_k=3)] * 2, 10)
    assert greedy.all_greedy and not greedy.all_random and greedy.temperature is None
    assert greedy.no_top_k and greedy.no_top_p and greedy.no_min_p and greedy.no_penalties
    assert greedy.max_num_logprobs is None

    mixed = make_metadata([SamplingParams(temperature=0.0, logprobs=1), SamplingParams(top_k=4, logprobs=3),
                           SamplingParams(top_k=50, top_p=0.9)], 10)
    assert not mixed.all_greedy and not mixed.all_random
    assert mixed.is_greedy.tolist() == [True, False, False]
    assert mixed.temperature.tolist() == [1.0, 1.0, 1.0]
    assert mixed.top_k.tolist() == [10, 4, 10] and mixed.max_top_k == 4  # 50 >= vocab: disabled
    assert not mixed.no_top_p and mixed.no_min_p
    assert mixed.max_num_logprobs == 3

    seeded = torch.Generator().manual_seed(0)
    random = make_metadata([SamplingParams(seed=0, min_p=0.1), SamplingParams(temperature=0.5)], 10,
                           generators=[seeded, None])
    assert random.all_random and random.is_greedy is None
    assert random.generators == {0: seeded}
    assert not random.no_min_p and random.no_top_k


def test_empty_batch(make_metadata) -> None:
    output = Sampler()(torch.zeros(0, 10), make_metadata([], 10))
    assert output.sampled_token_ids.shape == (0,)
