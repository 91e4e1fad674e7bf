"""The runner hands the sampler logits in the model's dtype (LM head compute_logits(dtype=None)); the
sampler's results equal those from the float32 upcast on every path (greedy without the upcast, and
logprobs, penalties, min_tokens, seeded and mixed batches with it)."""
from __future__ import annotations

import pytest
import torch

from pagedserve.layers.embedding import ParallelLMHead
from pagedserve.sample import Sampler, build_sampling_metadata
from pagedserve.sampling_params import SamplingParams

VOCAB = 40000  # > one block of sample/greedy.py, not a multiple of it, nor of the LM head's padding


def _metadata(params: list[SamplingParams], outputs: list[list[int]], seeds: bool) -> object:
    rows = len(params)
    generators = [torch.Generator().manual_seed(9 + row) if seeds and p.seed is not None else None
                  for row, p in enumerate(params)]
    return build_sampling_metadata(params, [[1, 2, 3]] * rows, outputs, generators, VOCAB, torch.device("cpu"))


BATCHES = {
    "greedy": [SamplingParams(temperature=0.0)] * 12,
    "greedy with logprobs": [SamplingParams(temperature=0.0, logprobs=3)] * 6 + [SamplingParams(temperature=0.0)] * 6,
    "greedy with penalties": [SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.3)] * 12,
    "greedy with min_tokens": [SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[7, 11])] * 12,
    "seeded random and greedy": [SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=3)] * 6
    + [SamplingParams(temperature=0.0, logprobs=1)] * 6,
}


@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sampler_results_equal_those_of_the_float32_upcast(name: str, dtype: torch.dtype) -> None:
    params = BATCHES[name]
    rows = len(params)
    # Few distinct values in the low-precision dtype: many ties, which the argmax must break alike.
    logits = (torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    logits[0, 123] = float("nan")
    outputs = [[5, 7, 5] if row % 2 else [] for row in range(rows)]
    sampler = Sampler()
    original = logits.clone()
    low = sampler(logits, _metadata(params, outputs, seeds=True))
    high = sampler(logits.float(), _metadata(params, outputs, seeds=True))
    assert torch.equal(logits.view(torch.int16), original.view(torch.int16))  # not modified (bitwise: NaN)
    assert torch.equal(low.sampled_token_ids, high.sampled_token_ids)
    assert (low.logprobs is None) == (high.logprobs is None)
    if low.logprobs is not None:
        assert torch.equal(low.logprobs.logprob_token_ids, high.logprobs.logprob_token_ids)
        assert torch.equal(low.logprobs.logprobs.view(torch.int32), high.logprobs.logprobs.view(torch.int32))
        assert torch.equal(low.logprobs.sampled_token_ranks, high.logprobs.sampled_token_ranks)


def test_lm_head_logits_in_the_model_dtype_upcast_to_the_float32_logits() -> None:
    dim = 16
    head = ParallelLMHead(VOCAB, dim, params_dtype=torch.bfloat16)
    head.weight.weight_loader(head.weight, torch.randn(VOCAB, dim, generator=torch.Generator().manual_seed(2)))
    hidden = torch.randn(3, dim, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    raw = head.compute_logits(hidden, dtype=None)
    default = head.compute_logits(hidden)
    assert raw.dtype == torch.bfloat16 and raw.shape == (3, VOCAB)
    assert default.dtype == torch.float32
    assert torch.equal(raw.float(), default)
