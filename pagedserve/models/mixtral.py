"""Mixtral: the Mistral attention with a sparse MoE in every layer (`block_sparse_moe`, experts w1/w3/w2).

Routing: softmax over all experts, top-k, renormalised over the chosen k.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from pagedserve.models.llama import LlamaAttention, config_head_dim
from pagedserve.models.moe_model import MoeForCausalLM, SparseMoeBlock


class MixtralForCausalLM(MoeForCausalLM):
    mlp_name = "block_sparse_moe"  # the HF name of the MoE in Mixtral checkpoints

    def build_rotary_embedding(self, hf_config: Any) -> RotaryEmbedding:
        return get_rope(config_head_dim(hf_config), int(hf_config.max_position_embeddings),
                        rope_parameters_from_config(hf_config))

    def build_attention(self, hf_config: Any, layer_index: int, rotary_emb: RotaryEmbedding,
                        params_dtype: torch.dtype, prefix: str) -> nn.Module:
        return LlamaAttention(hf_config, layer_index, rotary_emb, params_dtype=params_dtype, prefix=prefix)

    def build_mlp(self, hf_config: Any, layer_index: int, rotary_emb: RotaryEmbedding,
                  params_dtype: torch.dtype, prefix: str) -> nn.Module:
        return SparseMoeBlock(hf_config.hidden_size, int(hf_config.num_local_experts),
                              int(hf_config.num_experts_per_tok), int(hf_config.intermediate_size),
                              params_dtype=params_dtype, prefix=prefix, renormalize=True)

