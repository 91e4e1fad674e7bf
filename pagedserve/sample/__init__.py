"""Sampling: logits -> tokens and logprobs (vLLM v1 semantics)."""
from pagedserve.sample.logprobs import LogprobsTensors, compute_logprobs, compute_prompt_logprobs
from pagedserve.sample.sampler import Sampler, SamplerOutput
from pagedserve.sample.sampling_metadata import SamplingMetadata, build_sampling_metadata

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "build_sampling_metadata",
    "compute_logprobs",
    "compute_prompt_logprobs",
]
