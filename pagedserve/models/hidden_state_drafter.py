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
  aux_hidden_state_layer_ids            target layers whose inputs (EAGLE-3) or outputs (DFlash, DSpark:
                                        reads_layer_outputs) the drafter reads instead of the final hidden
                                        state, else ();
  attach_target(target)                 the target's embedding and LM head, which the drafter shares (not
                                        registered as the drafter's modules: loaded and laid out once).
"""
from __future__ import annotations

from abc import ABCMeta, abstractmethod
from typing import Any

import torch
from torch import nn

from pagedserve.models.llama import LlamaForCausalLM


class HiddenStateDrafter(LlamaForCausalLM, metaclass=ABCMeta):
    """Subclasses build their own modules (nn.Module.__init__, not Llama's) and reuse Llama's loader, which fuses
    q/k/v and gate/up and names any checkpoint tensor that matches no parameter. `checkpoint_names` (the tensors
    the checkpoint holds) decide the optional parts (biases, own embedding or head, vocabulary map)."""

    aux_hidden_state_layer_ids: tuple[int, ...] = ()
    # True: aux_hidden_state_layer_ids name layer outputs (DFlash, DSpark); False: layer inputs (EAGLE-3).
    reads_layer_outputs = False
    lm_head_is_tied = False

    def __init__(self, hf_config: Any, dtype: torch.dtype, checkpoint_names: frozenset[str] = frozenset()) -> None:
        nn.Module.__init__(self)
        self.config = hf_config
        self.dtype = dtype
        # The checkpoint's tensor names, an optional leading 'model.' dropped.
        self.checkpoint_tensor_names = frozenset(strip_prefix(name) for name in checkpoint_names)
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

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                hidden_states: torch.Tensor, step_index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states for compute_logits, hidden states the next draft step takes)."""

    def compute_logits(self, hidden_states: torch.Tensor,  # type: ignore[override]
                       step_index: int = 0) -> torch.Tensor:
        assert self.target_lm_head is not None, "attach_target() before the first forward"
        return self.target_lm_head.compute_logits(hidden_states, torch.float32)

    def stage_weights(self, weights: Any) -> Any:
        return weights  # a drafter is never split over pipeline stages (speculation rejects them)

    # ---- a draft vocabulary smaller than the target's (EAGLE-3, DFlash, DSpark) -----------------
    def init_vocab_map(self, hf_config: Any) -> None:
        """draft_vocab_size and the d2t buffer (target id of draft id i: i + draft_id_to_target_id[i]), loaded when
        the checkpoint has a d2t tensor."""
        has_vocab_map = "d2t" in self.checkpoint_tensor_names
        self.vocab_size = int(hf_config.vocab_size)
        self.draft_vocab_size = int(getattr(hf_config, "draft_vocab_size", None) or self.vocab_size)
        self.register_buffer("draft_id_to_target_id", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.has_vocab_map = has_vocab_map
        if not has_vocab_map and self.draft_vocab_size != self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} differs from vocab_size={self.vocab_size} "
                             f"but the checkpoint has no d2t tensor mapping draft ids to target ids")

    def load_vocab_map(self, tensor: torch.Tensor) -> None:
        """The checkpoint's d2t tensor, checked to map every draft id into the target vocabulary."""
        if tuple(tensor.shape) != (self.draft_vocab_size,):
            raise ValueError(f"checkpoint tensor 'd2t' has shape {tuple(tensor.shape)}, expected "
                             f"({self.draft_vocab_size},) (draft_vocab_size)")
        target_ids = torch.arange(self.draft_vocab_size) + tensor.to(torch.long).cpu()
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= self.vocab_size:
            raise ValueError(f"checkpoint tensor 'd2t' maps draft ids to target ids outside [0, {self.vocab_size})")
        self.draft_id_to_target_id.copy_(tensor.to(torch.long))

    def load_vocab_mapped_weights(self, weights: Any) -> set[str]:
        """Load an EAGLE-3 / DFlash / DSpark checkpoint: an optional leading 'model.' dropped, 'midlayer.' read as
        'layers.0.', d2t into the vocabulary map, t2d (the reverse map) and mask_embedding (unused) skipped."""
        def drafter_weights() -> Any:
            for name, tensor in weights:
                name = strip_prefix(name)
                if name.startswith("midlayer."):
                    name = "layers.0." + name[len("midlayer."):]
                if name in ("t2d", "mask_embedding"):
                    continue
                if name == "d2t":
                    self.load_vocab_map(tensor)
                    continue
                yield name, tensor

        return self.load_stage_weights(drafter_weights())

    def map_draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.draft_id_to_target_id[draft_ids] if self.has_vocab_map else draft_ids

    def to_target_vocab(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[n, draft vocab] logits -> [n, target vocab], -inf where no draft id maps."""
        if not self.has_vocab_map:
            return draft_logits
        target_ids = self.map_draft_to_target(torch.arange(self.draft_vocab_size, device=draft_logits.device))
        full = draft_logits.new_full((draft_logits.shape[0], self.vocab_size), float("-inf"))
        full[:, target_ids] = draft_logits
        return full


def strip_prefix(name: str, prefix: str = "model.") -> str:
    return name[len(prefix):] if name.startswith(prefix) else name


__all__ = ["HiddenStateDrafter", "strip_prefix"]
