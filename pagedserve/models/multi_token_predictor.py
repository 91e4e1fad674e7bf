"""Multi-token prediction drafter (speculative method 'mtp') for DeepSeek-V3 and GLM-4.5 MoE checkpoints.

The MTP layers are stored in the target's own checkpoint after its last decoder layer: for an L-layer model
with `num_nextn_predict_layers` = n, layers L .. L + n - 1, each `model.layers.{i}.` + enorm.weight,
hnorm.weight, eh_proj.weight [H, 2H], shared_head.norm.weight, shared_head.head.weight [vocab, H],
embed_tokens.weight (a copy of the target's: the target's own is used), and a full decoder layer of the
target's kind (self_attn.*, mlp.* with routed and shared experts, input_layernorm, post_attention_layernorm).

Position p: eh_proj([enorm(embed(token p + 1)), hnorm(target hidden p)]) -> the decoder layer -> hidden +
residual, whose shared head (norm, then head) gives the token at p + 2. Draft k uses MTP layer k mod n, fed its
own previous output (as vLLM runs them).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.distributed import get_lmhead_tp_group
from pagedserve.layers.embedding import ParallelLMHead
from pagedserve.layers.linear import ReplicatedLinear
from pagedserve.layers.norm import RMSNorm
from pagedserve.models.hidden_state_drafter import HiddenStateDrafter
from pagedserve.models.moe_model import MoeDecoderLayer, MoeForCausalLM

# Targets whose checkpoints carry MTP layers this drafter runs.
MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")


def num_mtp_layers(hf_config: Any) -> int:
    return int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)


class SharedHead(nn.Module):
    def __init__(self, hf_config: Any, dtype: torch.dtype, has_head: bool, prefix: str) -> None:
        super().__init__()
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, params_dtype=dtype)
        if has_head:
            self.head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, params_dtype=dtype,
                                       prefix=f"{prefix}.head", group=get_lmhead_tp_group())


class MultiTokenPredictorLayer(MoeDecoderLayer):
    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hf_config: Any, dtype: torch.dtype, has_head: bool,
                 prefix: str) -> None:
        hidden_size = hf_config.hidden_size
        super().__init__(self_attn, mlp, hidden_size, hf_config.rms_norm_eps, dtype)
        self.enorm = RMSNorm(hidden_size, hf_config.rms_norm_eps, params_dtype=dtype)
        self.hnorm = RMSNorm(hidden_size, hf_config.rms_norm_eps, params_dtype=dtype)
        self.eh_proj = ReplicatedLinear(2 * hidden_size, hidden_size, bias=False, params_dtype=dtype,
                                        prefix=f"{prefix}.eh_proj")
        self.shared_head = SharedHead(hf_config, dtype, has_head, f"{prefix}.shared_head")

    def predict(self, positions: torch.Tensor, embeds: torch.Tensor, previous_hidden: torch.Tensor) -> torch.Tensor:
        # Position 0 has no previous token: its embedding is masked, as in training.
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0)
        hidden_states = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous_hidden)], dim=-1))
        hidden_states, residual = self(positions, hidden_states, None)
        return hidden_states + residual


class MultiTokenPredictor(HiddenStateDrafter, MoeForCausalLM):
    """The target's MTP layers; `target` gives the layer factories (attention, MLP, rotary embedding)."""

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, *, target: MoeForCausalLM,
                 checkpoint_names: frozenset[str] = frozenset()) -> None:
        HiddenStateDrafter.__init__(self, hf_config, dtype, checkpoint_names)
        # The target family's loader mappings (DeepSeek's MLA has no fused q/k/v).
        self.packed_modules_mapping = type(target).packed_modules_mapping
        self.stacked_params_mapping = type(target).stacked_params_mapping
        self.renamed_params = type(target).renamed_params
        self.first_layer = int(hf_config.num_hidden_layers)
        self.num_layers = num_mtp_layers(hf_config)
        self.rotary_emb = target.build_rotary_embedding(hf_config)
        layers: dict[str, nn.Module] = {}
        for index in range(self.first_layer, self.first_layer + self.num_layers):
            prefix = f"model.layers.{index}"
            layers[str(index)] = MultiTokenPredictorLayer(
                target.build_attention(hf_config, index, self.rotary_emb, dtype, f"{prefix}.self_attn"),
                target.build_mlp(hf_config, index, self.rotary_emb, dtype, f"{prefix}.mlp"),
                hf_config, dtype, has_head=f"layers.{index}.shared_head.head.weight" in self.checkpoint_tensor_names, prefix=prefix)
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict(layers)

    def loads_layer(self, layer_index: int) -> bool:
        return self.first_layer <= layer_index < self.first_layer + self.num_layers

    def _layer(self, step_index: int) -> MultiTokenPredictorLayer:
        layer = self.model.layers[str(self.first_layer + step_index % self.num_layers)]
        assert isinstance(layer, MultiTokenPredictorLayer)
        return layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                hidden_states: torch.Tensor, step_index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        self.rotary_emb.clear_memo()
        hidden_states = self._layer(step_index).predict(positions, self.embed(input_ids),
                                                        hidden_states.to(self.dtype))
        return hidden_states, hidden_states

    def compute_logits(self, hidden_states: torch.Tensor,  # type: ignore[override]
                       step_index: int = 0) -> torch.Tensor:
        shared_head = self._layer(step_index).shared_head
        head = shared_head._modules.get("head") or self.target_lm_head
        assert head is not None, "attach_target() before the first forward"
        return head.compute_logits(shared_head.norm(hidden_states), torch.float32)

    def load_weights(self, weights: Any) -> set[str]:
        return MoeForCausalLM.load_weights(self, (
            (name, tensor) for name, tensor in weights if not name.endswith(".embed_tokens.weight")))


__all__ = ["MTP_ARCHITECTURES", "MultiTokenPredictor", "num_mtp_layers"]
