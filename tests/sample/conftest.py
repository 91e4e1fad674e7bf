"""Shared helpers for the sampler tests: build metadata and sample in one call."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pagedserve.sample import Sampler, SamplerOutput, SamplingMetadata, build_sampling_metadata
from pagedserve.sampling_params import SamplingParams

SampleFunction = Callable[..., SamplerOutput]


def build_metadata(
    params: list[SamplingParams],
    vocab_size: int,
    prompt_token_ids: list[list[int]] | None = None,
    output_token_ids: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingMetadata:
    num_rows = len(params)
    return build_sampling_metadata(
        params,
        prompt_token_ids if prompt_token_ids is not None else [[] for _ in range(num_rows)],
        output_token_ids if output_token_ids is not None else [[] for _ in range(num_rows)],
        generators if generators is not None else [None] * num_rows,
        vocab_size,
        torch.device("cpu"),
    )


@pytest.fixture
def sample() -> SampleFunction:
    """sample(logits, params, **build_metadata keywords) -> SamplerOutput."""
    sampler = Sampler()

    def run(logits: torch.Tensor, params: list[SamplingParams], **keywords: object) -> SamplerOutput:
        return sampler(logits, build_metadata(params, logits.shape[1], **keywords))

    return run


@pytest.fixture
def make_metadata() -> Callable[..., SamplingMetadata]:
    """make_metadata(params, vocab_size, prompt_token_ids=, output_token_ids=, generators=) on the CPU."""
    return build_metadata
