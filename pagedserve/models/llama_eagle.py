"""EAGLE drafter (speculative method 'eagle'), in the EAGLE checkpoint format.

Checkpoint tensors (an optional leading 'model.' is ignored): fc.weight [H, 2H] (fc.bias when trained with
one), layers.N.* Llama decoder layers (layer 0 has no input_layernorm: the fc output goes straight into
attention), embed_tokens.weight (a copy of the target's: the target's own embedding is used). No final norm
and no LM head: the output goes through the target's LM head as it is, the target's final hidden states
being what EAGLE learns to predict.

Position p: fc([embed(token p + 1), target hidden p]) -> decoder layers -> hidden (+ residual), whose logits
give the token at p + 2 and which is the hidden input of the next draft.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from pagedserve.layers.linear import ReplicatedLinear
from pagedserve.models.hidden_state_drafter import HiddenStateDrafter, strip_prefix
from pagedserve.models.llama import LlamaAttention, LlamaDecoderLayer, config_head_dim
from pagedserve.layers.rotary import get_rope, rope_parameters_from_config


class EagleLlamaForCausalLM(HiddenStateDrafter):
    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, *,
                 checkpoint_names: frozenset[str] = frozenset()) -> None:
        super().__init__(hf_config, dtype, checkpoint_names)
        hidden_size = hf_config.hidden_size
        self.fc = ReplicatedLinear(2 * hidden_size, hidden_size, bias="fc.bias" in self.checkpoint_tensor_names, params_dtype=dtype, prefix="fc")
        self.rotary_emb = get_rope(config_head_dim(hf_config), int(hf_config.max_position_embeddings),
                                   rope_parameters_from_config(hf_config))
        self.layers = nn.ModuleList([
            LlamaDecoderLayer(hf_config, index, self.rotary_emb, LlamaAttention, params_dtype=dtype,
                              prefix=f"drafter.layers.{index}")
            for index in range(int(hf_config.num_hidden_layers))])
        self.layers[0].input_layernorm = nn.Identity()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                hidden_states: torch.Tensor, step_index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        self.rotary_emb.clear_memo()
        hidden_states = self.fc(torch.cat([self.embed(input_ids), hidden_states.to(self.dtype)], dim=-1))
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        assert residual is not None
        hidden_states = hidden_states + residual
        return hidden_states, hidden_states

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def drafter_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = strip_prefix(name)
                if name.startswith(("embed_tokens.", "lm_head.")) or name.startswith("layers.0.input_layernorm."):
                    continue  # the target's embedding and head are used; layer 0 has no input norm
                yield name, tensor

        return self.load_stage_weights(drafter_weights())


__all__ = ["EagleLlamaForCausalLM"]
