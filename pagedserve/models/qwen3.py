"""Qwen3: the Llama decoder with per-head RMSNorm on queries and keys before RoPE, and head_dim from the config."""
from __future__ import annotations

from typing import Any

import torch

from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, hf_config: Any, layer_index: int, rotary_emb: RotaryEmbedding, *,
                 params_dtype: torch.dtype, prefix: str) -> None:
        super().__init__(hf_config, layer_index, rotary_emb, params_dtype=params_dtype, prefix=prefix)
        self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, params_dtype=params_dtype)
        self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, params_dtype=params_dtype)

    def normalize_query_key(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = query.shape[0]
        query = self.q_norm(query.reshape(num_tokens, self.num_heads, self.head_dim))
        key = self.k_norm(key.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        return query.reshape(num_tokens, self.q_size), key.reshape(num_tokens, self.kv_size)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_class = Qwen3Attention
