"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA) and DeepSeek MoE.

Attention (HF names under self_attn): q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj when q_lora_rank is
set; kv_a_proj_with_mqa gives the compressed latent (kv_lora_rank) and the shared rope key
(qk_rope_head_dim); kv_a_layernorm normalises the latent; kv_b_proj expands it into per-head k_nope and v;
o_proj. The paged cache stores only the latent and the rotated rope key (pagedserve.layers.mla_attention).
DeepSeek lays rope dimensions out as interleaved pairs (V2 always, V3 when `rope_interleave`): they are
de-interleaved before a standard rotation, the same permutation for queries and keys, so every q.k is
exactly HF's.

MoE: layers from `first_k_dense_replace` on. V2: softmax scores, 'greedy' or 'group_limited_greedy'
(groups ranked by their best score), no renormalisation. V3: sigmoid scores, e_score_correction_bias for
the choice, groups ranked by the sum of their two best scores, renormalised when norm_topk_prob. Both scale
by routed_scaling_factor and add `n_shared_experts` shared experts.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedserve.layers.mla_attention import MLAAttention
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from pagedserve.models.llama import LlamaMLP
from pagedserve.models.moe_model import MoeForCausalLM, SparseMoeBlock

# HF's DeepSeek latent norms use their default epsilon, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(hf_config: Any) -> float:
    """qk_head_dim^-0.5, times mscale^2 under yarn with mscale_all_dim (as HF)."""
    scale = (int(hf_config.qk_nope_head_dim) + int(hf_config.qk_rope_head_dim)) ** -0.5
    parameters = rope_parameters_from_config(hf_config)
    if parameters.get("rope_type", "default") != "default":
        mscale_all_dim = parameters.get("mscale_all_dim", 0)
        factor = float(parameters.get("factor", 1.0))
        if mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale = scale * mscale * mscale
    return scale


class DeepseekMLAAttentionBlock(nn.Module):
    def __init__(self, hf_config: Any, layer_index: int, rotary_emb: RotaryEmbedding, *,
                 params_dtype: torch.dtype, prefix: str, rope_interleave: bool) -> None:
        super().__init__()
        hidden_size = hf_config.hidden_size
        self.total_num_heads = int(hf_config.num_attention_heads)
        self.qk_nope_head_dim = int(hf_config.qk_nope_head_dim)
        self.qk_rope_head_dim = int(hf_config.qk_rope_head_dim)
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.v_head_dim = int(hf_config.v_head_dim)
        self.kv_lora_rank = int(hf_config.kv_lora_rank)
        self.q_lora_rank = hf_config.q_lora_rank
        bias = bool(getattr(hf_config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden_size, self.total_num_heads * self.qk_head_dim, bias=False,
                                               params_dtype=params_dtype, prefix=f"{prefix}.q_proj")
        else:
            self.q_a_proj = ReplicatedLinear(hidden_size, int(self.q_lora_rank), bias=bias,
                                             params_dtype=params_dtype, prefix=f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(int(self.q_lora_rank), LATENT_NORM_EPS, params_dtype=params_dtype)
            self.q_b_proj = ColumnParallelLinear(int(self.q_lora_rank), self.total_num_heads * self.qk_head_dim,
                                                 bias=False, params_dtype=params_dtype, prefix=f"{prefix}.q_b_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden_size, self.kv_lora_rank + self.qk_rope_head_dim,
                                                   bias=bias, params_dtype=params_dtype,
                                                   prefix=f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, params_dtype=params_dtype)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank,
                                              self.total_num_heads * (self.qk_nope_head_dim + self.v_head_dim),
                                              bias=False, params_dtype=params_dtype, prefix=f"{prefix}.kv_b_proj")
        # MLA attention reads this weight itself (weight absorption): it keeps the plain layout.
        self.kv_b_proj.weight_read_elsewhere = True
        self.o_proj = RowParallelLinear(self.total_num_heads * self.v_head_dim, hidden_size, bias=bias,
                                        params_dtype=params_dtype, prefix=f"{prefix}.o_proj")
        self.num_heads = self.kv_b_proj.output_size_per_partition // (self.qk_nope_head_dim + self.v_head_dim)
        self.rotary_emb = rotary_emb
        # Interleaved pairs (x0, x1), (x2, x3)... -> evens then odds: the layout standard RoPE rotates.
        self.rope_permutation = (torch.cat([torch.arange(0, self.qk_rope_head_dim, 2),
                                            torch.arange(1, self.qk_rope_head_dim, 2)])
                                 if rope_interleave else None)
        self.mla_attn = MLAAttention(self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim,
                                     self.kv_lora_rank, mla_softmax_scale(hf_config), self.kv_b_proj,
                                     prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        _, q_nope, q_pe, kv_c, k_pe = self.project(positions, hidden_states)
        return self.o_proj(self.mla_attn(q_nope, q_pe, kv_c, k_pe))

    def project(self, positions: torch.Tensor, hidden_states: torch.Tensor
                ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_latent, q_nope [n, H, nope], q_pe [n, H, rope], kv_c [n, R], k_pe [n, rope]): the normalised q-LoRA
        latent (None without q_lora_rank), the query parts and the normalised latent, rope parts rotated."""
        num_tokens = hidden_states.shape[0]
        q_latent = None
        if self.q_lora_rank is None:
            query = self.q_proj(hidden_states)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(hidden_states))
            query = self.q_b_proj(q_latent)
        query = query.view(num_tokens, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = query.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.qk_rope_head_dim],
                                                                  dim=-1)
        kv_c = self.kv_a_layernorm(kv_c.contiguous())
        if self.rope_permutation is not None:
            q_pe = q_pe[..., self.rope_permutation]
            k_pe = k_pe[..., self.rope_permutation]
        q_pe, k_pe = self.rotary_emb(positions, q_pe.contiguous(), k_pe.contiguous())
        return q_latent, q_nope, q_pe.view(num_tokens, self.num_heads, self.qk_rope_head_dim), kv_c, k_pe


class DeepseekV2ForCausalLM(MoeForCausalLM):
    # MLA has no fused q/k/v: only gate/up are packed.
    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}
    stacked_params_mapping = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
    rope_interleave_default = True  # V2 always rotates interleaved pairs

    def rope_interleave(self, hf_config: Any) -> bool:
        return self.rope_interleave_default

    def build_rotary_embedding(self, hf_config: Any) -> RotaryEmbedding:
        return get_rope(int(hf_config.qk_rope_head_dim), int(hf_config.max_position_embeddings),
                        rope_parameters_from_config(hf_config))

    def build_attention(self, hf_config: Any, layer_index: int, rotary_emb: RotaryEmbedding,
                        params_dtype: torch.dtype, prefix: str) -> nn.Module:
        return DeepseekMLAAttentionBlock(hf_config, layer_index, rotary_emb, params_dtype=params_dtype,
                                         prefix=prefix, rope_interleave=self.rope_interleave(hf_config))

    def routing(self, hf_config: Any) -> dict[str, Any]:
        method = getattr(hf_config, "topk_method", "greedy")
        grouped = method == "group_limited_greedy"
        return dict(scoring_func="softmax", renormalize=False,
                    num_expert_group=int(hf_config.n_group) if grouped else None,
                    topk_group=int(hf_config.topk_group) if grouped else None, group_score="max",
                    routed_scaling_factor=float(hf_config.routed_scaling_factor))

    def build_mlp(self, hf_config: Any, layer_index: int, rotary_emb: RotaryEmbedding,
                  params_dtype: torch.dtype, prefix: str) -> nn.Module:
        return deepseek_style_mlp(hf_config, layer_index, params_dtype, prefix, self.routing(hf_config))


def deepseek_style_mlp(hf_config: Any, layer_index: int, params_dtype: torch.dtype, prefix: str,
                       routing: dict[str, Any]) -> nn.Module:
    """The first `first_k_dense_replace` layers are dense (or those `mlp_layer_types` calls "dense", where the
    config lists them: DeepSeek-V3.2, GLM-5); the rest are routed experts plus `n_shared_experts` shared ones
    (DeepSeek-V2/V3 and GLM-4.5 MoE share this layout)."""
    mlp_layer_types = getattr(hf_config, "mlp_layer_types", None)
    if mlp_layer_types is not None:
        is_dense = mlp_layer_types[layer_index] == "dense"
    else:
        is_dense = layer_index < int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
    if is_dense:
        return LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size, bias=False,
                        params_dtype=params_dtype, prefix=prefix)
    num_shared = int(getattr(hf_config, "n_shared_experts", 0) or 0)
    return SparseMoeBlock(hf_config.hidden_size, int(hf_config.n_routed_experts),
                          int(hf_config.num_experts_per_tok), int(hf_config.moe_intermediate_size),
                          params_dtype=params_dtype, prefix=prefix, router_in_float32=True,
                          shared_intermediate_size=int(hf_config.moe_intermediate_size) * num_shared,
                          shared_expert_name="shared_experts", **routing)


def noaux_tc_routing(hf_config: Any) -> dict[str, Any]:
    """DeepSeek-V3 / GLM-4.5 routing: sigmoid, corrected choice, top-2-sum groups."""
    return dict(scoring_func="sigmoid", renormalize=bool(hf_config.norm_topk_prob),
                num_expert_group=int(hf_config.n_group or 1), topk_group=int(hf_config.topk_group or 1),
                group_score="top2_sum", use_correction_bias=True,
                routed_scaling_factor=float(hf_config.routed_scaling_factor))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    def rope_interleave(self, hf_config: Any) -> bool:
        return bool(getattr(hf_config, "rope_interleave", True))

    def routing(self, hf_config: Any) -> dict[str, Any]:
        return noaux_tc_routing(hf_config)
