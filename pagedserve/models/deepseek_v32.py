"""DeepSeek-V3.2 (and, through `indexer_types`, GLM-5): DeepSeek-V3's MLA and MoE with DeepSeek sparse attention.

Each attention block adds the lightning indexer (HF names under self_attn.indexer: wq_b, wk, k_norm,
weights_proj; layers/lightning_indexer.py) on the q-LoRA latent and the hidden state, and its MLA attends only to
the `index_topk` positions the indexer selects per query token (layers/sparse_mla_attention.py). The indexer's keys
are a second component of the layer's cache pages, under the latent's block ids.

`indexer_types` (GLM-5; DeepSeek-V3.2 has none: every layer is "full"): a "full" layer runs its own indexer, a
"shared" one has none and reuses the selection of the closest full layer before it, as transformers does.

Differences from DeepSeek-V3 that matter: the main attention always rotates interleaved rope pairs; the indexer
rotates its rope part as halves (DeepSeek-V3.2) or as interleaved pairs (GLM-5, `indexer_rope_interleave`); which
MLPs are dense follows `mlp_layer_types`. The native decode stack declines these models (not plain Llama layers).
kv_cache_dtype="int8" gives them the C8 page (attention/sparse_int8_cache.py).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.layers.lightning_indexer import LightningIndexer
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.layers.sparse_mla_attention import SparseMLAAttention
from pagedserve.models.deepseek_v2 import (
    DeepseekMLAAttentionBlock,
    DeepseekV3ForCausalLM,
    mla_softmax_scale,
)


def indexer_types(hf_config: Any) -> list[str]:
    """Per layer "full" (runs its indexer) or "shared" (reuses the previous full layer's selection)."""
    num_layers = int(hf_config.num_hidden_layers)
    types = getattr(hf_config, "indexer_types", None)
    if types is None:
        return ["full"] * num_layers
    types = list(types)
    if len(types) != num_layers or any(kind not in ("full", "shared") for kind in types):
        raise ValueError(f"indexer_types={types} must list 'full' or 'shared' for each of the {num_layers} layers")
    if types and types[0] != "full":
        raise ValueError(f"indexer_types={types}: the first layer must be 'full' (a shared layer reuses the "
                         f"selection of a full layer before it)")
    return types


class DeepseekSparseAttentionBlock(DeepseekMLAAttentionBlock):
    """DeepSeek-V3 MLA projections + (on full layers) the lightning indexer, over SparseMLAAttention."""

    def __init__(self, hf_config: Any, layer_index: int, rotary_emb: RotaryEmbedding, *,
                 params_dtype: torch.dtype, prefix: str, indexer_rope_interleave: bool,
                 selection_source: SparseMLAAttention | None) -> None:
        """`selection_source` None: this layer runs its own indexer; else it reuses that layer's selection."""
        super().__init__(hf_config, layer_index, rotary_emb, params_dtype=params_dtype, prefix=prefix,
                         rope_interleave=True)
        if self.q_lora_rank is None:
            raise ValueError(f"{prefix}: DeepSeek sparse attention needs q_lora_rank (its indexer reads the q latent)")
        index_head_dim = int(hf_config.index_head_dim)
        self.indexer = None
        if selection_source is None:
            self.indexer = LightningIndexer(
                hf_config.hidden_size, int(self.q_lora_rank), int(hf_config.index_n_heads), index_head_dim,
                self.qk_rope_head_dim, rotary_emb, rope_interleave=indexer_rope_interleave, params_dtype=params_dtype,
                prefix=f"{prefix}.indexer")
        self.mla_attn = SparseMLAAttention(
            self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, self.kv_lora_rank,
            mla_softmax_scale(hf_config), self.kv_b_proj, index_topk=int(hf_config.index_topk),
            index_head_dim=index_head_dim if selection_source is None else None, selection_source=selection_source,
            prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q_latent, q_nope, q_pe, kv_c, k_pe = self.project(positions, hidden_states)
        index = self.indexer(positions, hidden_states, q_latent) if self.indexer is not None else None
        return self.o_proj(self.mla_attn(q_nope, q_pe, kv_c, k_pe, index))


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    # DeepSeek-V3.2's indexer rotates halves; GLM-5's rotates interleaved pairs.
    indexer_rope_interleave = False

    def build_attention(self, hf_config: Any, layer_index: int, rotary_emb: RotaryEmbedding,
                        params_dtype: torch.dtype, prefix: str) -> nn.Module:
        # Blocks built so far, by layer index (a plain dict: the layers own them as modules).
        built: dict[int, DeepseekSparseAttentionBlock] = self.__dict__.setdefault("_sparse_attention_blocks", {})
        types = indexer_types(hf_config)
        source = None
        if types[layer_index] == "shared":
            full_index = max(index for index in range(layer_index) if types[index] == "full")
            if full_index not in built:
                raise ValueError(f"layer {layer_index} shares the indexer selection of layer {full_index}, which this "
                                 f"process does not hold (pipeline stages must not split such a pair)")
            source = built[full_index].mla_attn
        block = DeepseekSparseAttentionBlock(hf_config, layer_index, rotary_emb, params_dtype=params_dtype,
                                             prefix=prefix, indexer_rope_interleave=self.indexer_rope_interleave,
                                             selection_source=source)
        built[layer_index] = block
        return block


__all__ = ["DeepseekSparseAttentionBlock", "DeepseekV32ForCausalLM", "indexer_types"]
