"""Prefill context parallel (PCP): `prefill_context_parallel_size` copies of the TP x PP model split each step's tokens.

vLLM's knob, with the ranks it adds (world = TP x PP x PCP). Every step the PCP ranks receive the same scheduler
output and build the same inputs; each runs the model on one contiguous run of the step's flat token list
(`TokenSplit`: ceil(n / size) rows a rank, the last run padded), so a long prompt's projections, MLPs and norms are
divided by PCP. Attention is the one place the ranks meet (attention/decode_context_parallel.py): the KV positions of
every request are split over the PCP (x DCP) ranks, position p on KV-group rank p % size, and each attention layer
gathers the step's queries (and the new K/V, which each rank writes where it owns the position), computes the
partial attention of every query over its own positions and merges the partials by log-sum-exp. Each rank's work in
attention is then 1/PCP of the whole whatever the causal shape (the positions are interleaved, so each rank holds
an equal share of every query's past): the head+tail ("zigzag") assignment vLLM uses to balance causal work is not
needed for it, and the token split stays contiguous. Decode tokens are split like prefill tokens (a one-token
batch leaves the other ranks a padding row). The last hidden states are all-gathered, so every rank samples the
same tokens from the same logits, as TP ranks do.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from pagedserve.distributed.parallel_state import GroupCoordinator

if TYPE_CHECKING:
    from pagedserve.config.engine import EngineConfig

# The models whose attention layers have a context-parallel form (dense / GQA / sliding window, MLA, DeepSeek sparse
# attention) and whose other layers act on each token alone.
PREFILL_CONTEXT_PARALLEL_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM", "Glm4MoeForCausalLM", "GlmMoeDsaForCausalLM",
)


class TokenSplit:
    """A step's `num_tokens` rows split over the PCP group: rank r holds rows [r * s, (r + 1) * s), s =
    ceil(num_tokens / size), the rows past num_tokens being padding."""

    def __init__(self, group: GroupCoordinator, num_tokens: int) -> None:
        self.group = group
        self.num_tokens = num_tokens
        self.num_local = -(-num_tokens // group.world_size)
        self.start = group.rank * self.num_local

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a step tensor [num_tokens, ...] (zero rows as padding)."""
        rows = tensor[self.start:self.start + self.num_local]
        if rows.shape[0] == self.num_local:
            return rows
        padding = tensor.new_zeros((self.num_local - rows.shape[0], *tensor.shape[1:]))
        return torch.cat([rows, padding])

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's rows [num_local, ...] concatenated into the step tensor [num_tokens, ...]."""
        return self.group.all_gather(tensor, dim=0)[:self.num_tokens]


class PrefillContextParallelForward:
    """The model runner's forward under PCP: this rank's rows of the step through the model, the step's hidden
    states gathered back."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 group: GroupCoordinator) -> None:
        self.forward = forward
        self.group = group

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        split = TokenSplit(self.group, input_ids.shape[0])
        hidden_states = self.forward(split.local(input_ids), split.local(positions))
        return split.gather(hidden_states)


def build_prefill_context_parallel_forward(
        engine_config: "EngineConfig", forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`forward` wrapped to split the step's tokens over the PCP group; `forward` itself without PCP."""
    if engine_config.parallel_config.prefill_context_parallel_size == 1:
        return forward
    from pagedserve.distributed.parallel_state import get_pcp_group

    return PrefillContextParallelForward(forward, get_pcp_group())


__all__ = ["PREFILL_CONTEXT_PARALLEL_ARCHITECTURES", "PrefillContextParallelForward", "TokenSplit",
           "build_prefill_context_parallel_forward"]
