"""LightningIndexer: the projections of DeepSeek sparse attention's indexer (HF names under self_attn.indexer).

From a token's hidden state x and the MLA block's normalised q-LoRA latent c_q:
- index queries q = wq_b(c_q) as [num_index_heads, index_head_dim];
- one index key k = k_norm(wk(x)) (a LayerNorm with bias), shared by the heads;
- per-head weights w = weights_proj(x) * num_index_heads^-0.5 (weights_proj kept and computed in float32, as HF
  keeps it);
then RoPE on the first qk_rope_head_dim dimensions of q and k (the rest pass through). DeepSeek-V3.2 rotates them
as halves, GLM-5 as interleaved pairs; interleaved pairs are de-interleaved first (the same permutation for q and k,
so every q . k is unchanged) and rotated as halves. Scoring and top-k selection are attention/lightning_indexer.py's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.linear import ReplicatedLinear
from pagedserve.layers.rotary import RotaryEmbedding

# HF's indexer key norm uses this epsilon whatever the config says.
INDEX_KEY_NORM_EPS = 1e-6


@dataclass
class IndexerProjections:
    """One step's indexer inputs: query [n, num_index_heads, index_head_dim] and key [n, index_head_dim], both
    rotated, and weights [n, num_index_heads] (float32)."""

    query: torch.Tensor
    key: torch.Tensor
    weights: torch.Tensor


class LightningIndexer(nn.Module):
    def __init__(self, hidden_size: int, q_lora_rank: int, num_index_heads: int, index_head_dim: int,
                 rope_dim: int, rotary_emb: RotaryEmbedding, *, rope_interleave: bool, params_dtype: torch.dtype,
                 prefix: str) -> None:
        super().__init__()
        if rope_dim > index_head_dim:
            raise ValueError(f"{prefix}: qk_rope_head_dim={rope_dim} must be <= index_head_dim={index_head_dim}")
        self.num_index_heads = num_index_heads
        self.index_head_dim = index_head_dim
        self.rope_dim = rope_dim
        # The indexer must select the same tokens on every tensor-parallel rank: its projections are replicated.
        self.wq_b = ReplicatedLinear(q_lora_rank, num_index_heads * index_head_dim, bias=False,
                                     params_dtype=params_dtype, prefix=f"{prefix}.wq_b")
        self.wk = ReplicatedLinear(hidden_size, index_head_dim, bias=False, params_dtype=params_dtype,
                                   prefix=f"{prefix}.wk")
        self.k_norm = nn.LayerNorm(index_head_dim, eps=INDEX_KEY_NORM_EPS, dtype=params_dtype)
        self.weights_proj = ReplicatedLinear(hidden_size, num_index_heads, bias=False, params_dtype=torch.float32,
                                             prefix=f"{prefix}.weights_proj")
        # Read in float32 by forward itself: it keeps the plain layout.
        self.weights_proj.weight_read_elsewhere = True
        self.rotary_emb = rotary_emb
        self.rope_permutation = (torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])
                                 if rope_interleave else None)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                q_latent: torch.Tensor) -> IndexerProjections:
        num_tokens = hidden_states.shape[0]
        query = self.wq_b(q_latent).view(num_tokens, self.num_index_heads, self.index_head_dim)
        key = self.k_norm(self.wk(hidden_states))
        q_rot, q_pass = query.split([self.rope_dim, self.index_head_dim - self.rope_dim], dim=-1)
        k_rot, k_pass = key.split([self.rope_dim, self.index_head_dim - self.rope_dim], dim=-1)
        if self.rope_permutation is not None:
            q_rot, k_rot = q_rot[..., self.rope_permutation], k_rot[..., self.rope_permutation]
        q_rot, k_rot = self.rotary_emb(positions, q_rot.contiguous(), k_rot.contiguous())
        query = torch.cat([q_rot.view(num_tokens, self.num_index_heads, self.rope_dim), q_pass], dim=-1)
        key = torch.cat([k_rot.view(num_tokens, self.rope_dim), k_pass], dim=-1)
        weights = F.linear(hidden_states.float(), self.weights_proj.weight.float()) * self.num_index_heads ** -0.5
        return IndexerProjections(query=query, key=key, weights=weights)

    def extra_repr(self) -> str:
        return (f"num_index_heads={self.num_index_heads}, index_head_dim={self.index_head_dim}, "
                f"rope_dim={self.rope_dim}, interleaved={self.rope_permutation is not None}")


__all__ = ["INDEX_KEY_NORM_EPS", "IndexerProjections", "LightningIndexer"]
