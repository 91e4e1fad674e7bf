"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 attention with sparse MoE MLPs.

Sparse layers: not in `mlp_only_layers` and (index + 1) % decoder_sparse_step == 0; the others keep a dense
MLP of `intermediate_size`. Routing is softmax top-k; Qwen3-MoE renormalises when `norm_topk_prob`,
Qwen2-MoE per its `norm_topk_prob` too, and adds a shared expert scaled by sigmoid(shared_expert_gate(x)).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from pagedserve.models.llama import LlamaMLP, config_head_dim
from pagedserve.models.moe_model import MoeForCausalLM, SparseMoeBlock
from pagedserve.models.qwen2 import Qwen2Attention
from pagedserve.models.qwen3 import Qwen3Attention


def is_sparse_layer(hf_config: Any, layer_index: int) -> bool:
    mlp_only_layers = getattr(hf_config, "mlp_only_layers", None) or []
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    return (layer_index not in mlp_only_layers and int(hf_config.num_experts) > 0
            and (layer_index + 1) % step == 0)


class QwenMoeForCausalLM(MoeForCausalLM):
    attention_class: type[nn.Module] = Qwen3Attention
    has_shared_expert = False

    def build_rotary_embedding(self, hf_config: Any) -> RotaryEmbedding:
        return get_rope(config_head_dim(hf_config), int(hf_config.max_position_embeddings),
                        rope_parameters_from_config(hf_config))

    def build_attention(self, hf_config: Any, layer_index: int, rotary_emb: RotaryEmbedding,
                        params_dtype: torch.dtype, prefix: str) -> nn.Module:
        return self.attention_class(hf_config, layer_index, rotary_emb, params_dtype=params_dtype, prefix=prefix)

    def build_mlp(self, hf_config: Any, layer_index: int, rotary_emb: RotaryEmbedding,
                  params_dtype: torch.dtype, prefix: str) -> nn.Module:
        if not is_sparse_layer(hf_config, layer_index):
            return LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size, bias=False,
                            params_dtype=params_dtype, prefix=prefix)
        shared = dict(shared_intermediate_size=int(hf_config.shared_expert_intermediate_size),
                      shared_expert_name="shared_expert", has_shared_expert_gate=True) \
            if self.has_shared_expert else {}
        return SparseMoeBlock(hf_config.hidden_size, int(hf_config.num_experts), int(hf_config.num_experts_per_tok),
                              int(hf_config.moe_intermediate_size), params_dtype=params_dtype, prefix=prefix,
                              renormalize=bool(hf_config.norm_topk_prob), **shared)


class Qwen3MoeForCausalLM(QwenMoeForCausalLM):
    attention_class = Qwen3Attention


class Qwen2MoeForCausalLM(QwenMoeForCausalLM):
    attention_class = Qwen2Attention
    has_shared_expert = True
