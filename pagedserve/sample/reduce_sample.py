"""reduce_sample: sample from a vocabulary-sharded LM head without gathering the full logits.

Each rank of the LM-head group computes its vocabulary shard of the logits, keeps its top-k* columns
(k* = the largest k the batch needs: 1 for greedy rows, top_k for random rows), and only those
candidates (values and global ids, [rows, group_size * k*]) are all-gathered. The candidates are
scattered into a -inf logits row, and the ordinary Sampler runs on it unchanged.

Exactness: the global top-k is contained in the union of the per-rank top-k, so greedy and top-k
sampling (with temperature, top-p after top-k, and min-p, which only compares a logit with the
maximum) pick exactly what the full-logits path picks; the exponential-race noise is drawn over the
full vocabulary shape from the same generators, so seeded top-k requests draw the same tokens too.
Requests for which the candidate set would be approximate are rejected (`check_reduce_sample_params`):
random sampling without top-k (the tail matters), penalties (they re-rank tokens outside the
candidates), min_tokens (masked stop tokens would need candidates past k) and sample logprobs (they
need the full distribution). Prompt logprobs still use the full-logits path.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pagedserve.sampling_params import SamplingParams


def check_reduce_sample_params(params: SamplingParams) -> None:
    """Raise ValueError naming the field when reduce_sample could not sample `params` exactly."""
    is_greedy = params.temperature == 0.0
    if not is_greedy and (params.top_k is None or params.top_k <= 0):
        raise ValueError(f"enable_reduce_sample=True samples only greedy or top-k requests exactly; got "
                         f"temperature={params.temperature} with top_k={params.top_k} (set top_k >= 1 or "
                         f"temperature=0)")
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        if getattr(params, name) != neutral:
            raise ValueError(f"enable_reduce_sample=True does not support {name}={getattr(params, name)} "
                             f"(penalties re-rank tokens outside the gathered candidates); allowed: {neutral}")
    if params.min_tokens:
        raise ValueError(f"enable_reduce_sample=True does not support min_tokens={params.min_tokens}; allowed: 0")
    if params.logprobs is not None:
        raise ValueError(f"enable_reduce_sample=True does not support logprobs={params.logprobs} (they need the "
                         f"full distribution); allowed: None")


def candidate_count(params_list: Sequence[SamplingParams]) -> int:
    """k*: how many candidates each rank contributes for this batch."""
    return max(1 if p.temperature == 0.0 else int(p.top_k) for p in params_list)


class ReduceSampleLogits:
    """Callable (hidden_states [rows, hidden], params per row) -> logits [rows, vocab] that are -inf
    outside the gathered candidates."""

    def __init__(self, model: nn.Module) -> None:
        self.lm_head = model.lm_head

    def __call__(self, hidden_states: torch.Tensor, params_list: Sequence[SamplingParams]) -> torch.Tensor:
        for params in params_list:
            check_reduce_sample_params(params)
        head = self.lm_head
        group = head.parallel_group
        local = head.compute_local_logits(hidden_states).float()
        # Padding columns (past the real vocabulary) must never be candidates.
        num_real = max(0, min(head.num_embeddings_per_partition, head.org_vocab_size - head.vocab_start_index))
        if num_real < local.shape[1]:
            local[:, num_real:] = float("-inf")
        k = min(candidate_count(params_list), local.shape[1])
        values, columns = local.topk(k, dim=-1)
        token_ids = columns + head.vocab_start_index
        values = group.all_gather(values, dim=-1)
        token_ids = group.all_gather(token_ids, dim=-1)
        logits = torch.full((local.shape[0], head.num_embeddings_padded), float("-inf"), dtype=torch.float32,
                            device=local.device)
        logits.scatter_(1, token_ids, values)
        return logits[:, : head.org_vocab_size]


def full_logits(model: nn.Module):  # type: ignore[no-untyped-def]
    """The default: every rank sees the full logits (the LM head gathers them), in the model's dtype:
    the Sampler upcasts them to float32 itself where it computes on them, and all-greedy batches take
    the argmax without the copy."""
    def compute(hidden_states: torch.Tensor, params_list: Sequence[SamplingParams]) -> torch.Tensor:
        return model.compute_logits(hidden_states, dtype=None)

    return compute


def sample_logits_function(model: nn.Module, enable_reduce_sample: bool):  # type: ignore[no-untyped-def]
    """The model runner's seam: how logits at the sampled positions are computed."""
    return ReduceSampleLogits(model) if enable_reduce_sample else full_logits(model)
