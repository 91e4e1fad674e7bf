"""MLAAttention: the model-side face of the latent (MLA) paged cache.

Holds one layer's `kv_cache` ([num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], set by the worker
from `kv_cache_spec()`), reads the step's metadata from the forward context and calls
pagedserve.attention.mla_paged. Without metadata (profiling/dummy runs) it attends the given tokens as
one causal sequence and leaves the cache untouched.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.attention.decode_context_parallel import mla_context_parallel_attention
from pagedserve.attention.forward_context import get_forward_context, save_kv_layer
from pagedserve.attention.kv_cache_spec import KVCacheSpec
from pagedserve.attention.mla_paged import attend_expanded, mla_paged_attention


class MLAAttention(nn.Module):
    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 kv_lora_rank: int, scale: float, kv_b_proj: nn.Module, prefix: str = "") -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.scale = scale
        self.layer_name = prefix
        # Not a submodule here (it belongs to the attention block, which owns its checkpoint name).
        self._kv_b_proj = [kv_b_proj]
        self.kv_cache: torch.Tensor | None = None

    def kv_cache_spec(self) -> KVCacheSpec:
        """One latent row per token: kv_lora_rank + qk_rope_head_dim values (no per-head K/V)."""
        return KVCacheSpec(per_token_shape=(self.kv_lora_rank + self.qk_rope_head_dim,), supports_int8=True,
                           latent_rank=self.kv_lora_rank)

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c_normed: torch.Tensor,
                k_pe: torch.Tensor) -> torch.Tensor:
        """q_nope [n, H, nope], q_pe [n, H, rope] (rotated), kv_c_normed [n, R], k_pe [n, rope] (rotated)
        -> [n, H * v_head_dim]."""
        num_tokens = q_nope.shape[0]
        latent = torch.cat([kv_c_normed, k_pe], dim=-1)
        kv_b_weight = self._kv_b_proj[0].weight
        metadata = get_forward_context().attn_metadata
        if metadata is None:
            output = attend_expanded(q_nope, q_pe, latent, kv_b_weight, self.kv_lora_rank, self.v_head_dim,
                                     self.scale)
        else:
            if self.kv_cache is None:
                raise RuntimeError(f"{self.layer_name}: attention metadata is set but no kv_cache is bound")
            attend = mla_paged_attention if metadata.context_parallel is None else mla_context_parallel_attention
            output = attend(q_nope, q_pe, latent, self.kv_cache, metadata, kv_b_weight, self.kv_lora_rank,
                            self.v_head_dim, self.scale)
            save_kv_layer(self.layer_name, self.kv_cache)
        return output.reshape(num_tokens, self.num_heads * self.v_head_dim)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk_rope_head_dim={self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}, scale={self.scale}")
