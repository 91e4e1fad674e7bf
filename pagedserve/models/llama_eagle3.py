"""EAGLE-3 drafter (speculative method 'eagle3'), in the EAGLE-3 checkpoint format.

Checkpoint tensors (an optional leading 'model.' is ignored): fc.weight [H, 3H] over the target's auxiliary
hidden states, midlayer.* (or layers.0.*) the first decoder layer, whose q/k/v take [input_layernorm(embed),
hidden_norm(hidden)] (2H wide), further layers.N.* plain Llama layers, norm.weight, lm_head.weight over the
draft vocabulary [draft_vocab_size, H], d2t [draft_vocab_size] (target id = draft id + d2t[draft id]; absent
when the draft vocabulary is the target's), t2d (unused), embed_tokens.weight optional (else the target's).

The auxiliary hidden states are the residual stream entering three target layers: the config's
`eagle_aux_hidden_state_layer_ids` (top level or under `eagle_config`), else layers (2, L // 2, L - 3) of an
L-layer target.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from pagedserve.distributed import get_lmhead_tp_group
from pagedserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.linear import QKVParallelLinear, ReplicatedLinear
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from pagedserve.models.hidden_state_drafter import HiddenStateDrafter
from pagedserve.models.llama import LlamaAttention, LlamaDecoderLayer, config_head_dim


def aux_hidden_state_layer_ids(hf_config: Any, target_num_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs the drafter reads; ValueError naming the knob when one is out of range."""
    eagle_config = getattr(hf_config, "eagle_config", None) or {}
    layer_ids = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None) \
        or eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if layer_ids is None:
        layer_ids = (2, target_num_layers // 2, target_num_layers - 3)
    layer_ids = tuple(int(index) for index in layer_ids)
    if len(layer_ids) != 3 or not all(0 <= index < target_num_layers for index in layer_ids):
        raise ValueError(f"EAGLE-3 drafter: eagle_aux_hidden_state_layer_ids={list(layer_ids)} must be 3 layer "
                         f"indices in [0, {target_num_layers}) of the target model (set them in the drafter's "
                         f"config.json)")
    return layer_ids


class Eagle3DecoderLayer(LlamaDecoderLayer):
    """The first layer: attention over [input_layernorm(embeds), hidden_norm(hidden)], the residual from the
    hidden input (normed first when the config says `norm_before_residual`)."""

    def __init__(self, hf_config: Any, rotary_emb: RotaryEmbedding, *, params_dtype: torch.dtype,
                 prefix: str) -> None:
        super().__init__(hf_config, 0, rotary_emb, LlamaAttention, params_dtype=params_dtype, prefix=prefix)
        attention = self.self_attn
        attention.qkv_proj = QKVParallelLinear(2 * hf_config.hidden_size, attention.head_dim,
                                               attention.total_num_heads, attention.total_num_kv_heads,
                                               bias=bool(getattr(hf_config, "attention_bias", False)),
                                               params_dtype=params_dtype, prefix=f"{prefix}.self_attn.qkv_proj")
        self.hidden_norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, params_dtype=params_dtype)
        self.norm_before_residual = bool(getattr(hf_config, "norm_before_residual", False))

    def forward_first(self, positions: torch.Tensor, embeds: torch.Tensor,
                      hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.input_layernorm(embeds)
        if self.norm_before_residual:
            hidden_states = self.hidden_norm(hidden_states)
            residual = hidden_states
        else:
            residual = hidden_states
            hidden_states = self.hidden_norm(hidden_states)
        hidden_states = self.self_attn(positions, torch.cat([embeds, hidden_states], dim=-1))
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.feed_forward(hidden_states), residual


class Eagle3LlamaForCausalLM(HiddenStateDrafter):
    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, *,
                 checkpoint_names: frozenset[str] = frozenset(), target_num_layers: int) -> None:
        super().__init__(hf_config, dtype, checkpoint_names)
        hidden_size = hf_config.hidden_size
        self.init_vocab_map(hf_config)
        self.aux_hidden_state_layer_ids = aux_hidden_state_layer_ids(hf_config, target_num_layers)
        target_hidden_size = int(getattr(hf_config, "target_hidden_size", None) or hidden_size)
        self.fc = ReplicatedLinear(3 * target_hidden_size, hidden_size, bias=False, params_dtype=dtype, prefix="fc")
        if "embed_tokens.weight" in self.checkpoint_tensor_names:
            self.embed_tokens = VocabParallelEmbedding(self.vocab_size, hidden_size, params_dtype=dtype,
                                                       prefix="embed_tokens")
        self.rotary_emb = get_rope(config_head_dim(hf_config), int(hf_config.max_position_embeddings),
                                   rope_parameters_from_config(hf_config))
        layers: list[nn.Module] = [Eagle3DecoderLayer(hf_config, self.rotary_emb, params_dtype=dtype,
                                                      prefix="drafter.layers.0")]
        layers += [LlamaDecoderLayer(hf_config, index, self.rotary_emb, LlamaAttention, params_dtype=dtype,
                                     prefix=f"drafter.layers.{index}")
                   for index in range(1, int(hf_config.num_hidden_layers))]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, hf_config.rms_norm_eps, params_dtype=dtype)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden_size, params_dtype=dtype, prefix="lm_head",
                                      group=get_lmhead_tp_group())

    def combine_hidden_states(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, 3 * target hidden] auxiliary hidden states -> [n, hidden]."""
        return self.fc(target_hidden_states.to(self.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                hidden_states: torch.Tensor, step_index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        self.rotary_emb.clear_memo()
        first = self.layers[0]
        assert isinstance(first, Eagle3DecoderLayer)
        hidden_states, residual = first.forward_first(positions, self.embed(input_ids), hidden_states)
        for layer in self.layers[1:]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        normed, prenorm = self.norm(hidden_states, residual)
        return normed, prenorm

    def compute_logits(self, hidden_states: torch.Tensor,  # type: ignore[override]
                       step_index: int = 0) -> torch.Tensor:
        return self.to_target_vocab(self.lm_head.compute_logits(hidden_states, torch.float32))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return self.load_vocab_mapped_weights(weights)


__all__ = ["Eagle3LlamaForCausalLM", "aux_hidden_state_layer_ids"]
