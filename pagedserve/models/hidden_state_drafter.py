"""HiddenStateDrafter: the base of speculative drafters that read the target model's hidden states (EAGLE,
EAGLE-3, multi-token prediction).

A drafter of this kind is a small network beside the target: each step it runs over the positions the target
just computed, taking at position p the token at p + 1 and the target's hidden state at p, and predicts the
token at p + 2; then it drafts further, feeding its own drafts and its own hidden states. Its attention layers
have KV caches of their own in the request's blocks (allocated with the target's).

The interface the proposer (spec_decode/hidden_state_proposer.py) uses:
  combine_hidden_states(target_hidden)  what the target's step hands over, as the first forward's hidden input;
  forward(input_ids, positions, hidden_states, step_index) -> (hidden for the logits, hidden for the next step);
  compute_logits(hidden, step_index)    [n, target vocab] float32;
  aux_hidden_state_layer_ids            target layers whose inputs (the residual stream) the drafter reads
                                        instead of the final hidden state (EAGLE-3), else ();
  attach_target(target)                 the target's embedding and LM head, which the drafter shares (not
                                        registered as the drafter's modules: loaded and laid out once).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.models.llama import LlamaForCausalLM


class HiddenStateDrafter(LlamaForCausalLM):
    """Subclasses build their own modules (nn.Module.__init__, not Llama's) and reuse Llama's loader, which fuses
    q/k/v and gate/up and names any checkpoint tensor that matches no parameter."""

    aux_hidden_state_layer_ids: tuple[int, ...] = ()
    lm_head_is_tied = False

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.config = hf_config
        self.dtype = dtype
        self.target_embed_tokens: nn.Module | None = None
        self.target_lm_head: nn.Module | None = None

    def attach_target(self, target: nn.Module) -> None:
        # object.__setattr__: shared, not submodules (their parameters are the target's to load and lay out).
        object.__setattr__(self, "target_embed_tokens", target.model.embed_tokens)
        object.__setattr__(self, "target_lm_head", target.lm_head)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The drafter's own embedding when its checkpoint has one, else the target's."""
        own = self._modules.get("embed_tokens")
        embedding = own if own is not None else self.target_embed_tokens
        assert embedding is not None, "attach_target() before the first forward"
        return embedding(input_ids)

    def combine_hidden_states(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        return target_hidden_states

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                hidden_states: torch.Tensor, step_index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor,  # type: ignore[override]
                       step_index: int = 0) -> torch.Tensor:
        assert self.target_lm_head is not None, "attach_target() before the first forward"
        return self.target_lm_head.compute_logits(hidden_states, torch.float32)

    def stage_weights(self, weights: Any) -> Any:
        return weights  # a drafter is never split over pipeline stages (speculation rejects them)


def strip_prefix(name: str, prefix: str = "model.") -> str:
    return name[len(prefix):] if name.startswith(prefix) else name


__all__ = ["HiddenStateDrafter", "strip_prefix"]
