"""GLM-4.5 MoE (Glm4MoeForCausalLM): GQA attention with partial rotary and optional q/k norm, DeepSeek-V3
style MoE (sigmoid + correction bias, grouped top-k, shared experts) from `first_k_dense_replace` on.

Partial rotary: only the first head_dim * partial_rotary_factor dimensions of each head are rotated
(standard half rotation within them); the rest pass through.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from pagedserve.models.deepseek_v2 import deepseek_style_mlp, noaux_tc_routing
from pagedserve.models.llama import LlamaAttention, config_head_dim
from pagedserve.models.moe_model import MoeForCausalLM


def rotary_dim(hf_config: Any) -> int:
    factor = float(rope_parameters_from_config(hf_config).get("partial_rotary_factor", 1.0))
    return int(config_head_dim(hf_config) * factor)


class Glm4MoeAttention(LlamaAttention):
    @classmethod
    def projection_biases(cls, hf_config: Any) -> tuple[bool, bool]:
        return bool(getattr(hf_config, "attention_bias", False)), False

    def __init__(self, hf_config: Any, layer_index: int, rotary_emb: RotaryEmbedding, *,
                 params_dtype: torch.dtype, prefix: str) -> None:
        super().__init__(hf_config, layer_index, rotary_emb, params_dtype=params_dtype, prefix=prefix)
        self.rotary_dim = rotary_dim(hf_config)
        self.use_qk_norm = bool(getattr(hf_config, "use_qk_norm", False))
        if self.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, params_dtype=params_dtype)
            self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, params_dtype=params_dtype)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        query, key, value = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = query.reshape(num_tokens, self.num_heads, self.head_dim)
        key = key.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        split = [self.rotary_dim, self.head_dim - self.rotary_dim]
        query_rot, query_pass = query.split(split, dim=-1)
        key_rot, key_pass = key.split(split, dim=-1)
        query_rot, key_rot = self.rotary_emb(positions, query_rot.contiguous(), key_rot.contiguous())
        query = torch.cat([query_rot, query_pass], dim=-1).reshape(num_tokens, self.q_size)
        key = torch.cat([key_rot, key_pass], dim=-1).reshape(num_tokens, self.kv_size)
        return self.o_proj(self.attn(query, key, value))


class Glm4MoeForCausalLM(MoeForCausalLM):
    def build_rotary_embedding(self, hf_config: Any) -> RotaryEmbedding:
        parameters = rope_parameters_from_config(hf_config)
        parameters.pop("partial_rotary_factor", None)  # the table is built for the rotated dims only
        return get_rope(rotary_dim(hf_config), int(hf_config.max_position_embeddings), parameters)

    def build_attention(self, hf_config: Any, layer_index: int, rotary_emb: RotaryEmbedding,
                        params_dtype: torch.dtype, prefix: str) -> nn.Module:
        return Glm4MoeAttention(hf_config, layer_index, rotary_emb, params_dtype=params_dtype, prefix=prefix)

    def build_mlp(self, hf_config: Any, layer_index: int, rotary_emb: RotaryEmbedding,
                  params_dtype: torch.dtype, prefix: str) -> nn.Module:
        return deepseek_style_mlp(hf_config, layer_index, params_dtype, prefix, noaux_tc_routing(hf_config))
