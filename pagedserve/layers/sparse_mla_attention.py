"""SparseMLAAttention: the model-side face of DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5).

An MLAAttention whose tokens attend only to the positions the lightning indexer selects. A layer that runs its
own indexer ("full") keeps the indexer's keys as a second component of its cache pages (KVCacheSpec
extra_components: one index_head_dim row per token beside the latent row, same block ids), writes this step's keys,
selects each token's top-k positions (attention/lightning_indexer.py) and keeps the selection for the step. A
layer without an indexer (GLM-5's "shared" layers) stores no keys and reuses the selection its `selection_source`
(the previous full layer) made in the same forward. Attention itself is attention/sparse_mla.py's.

Under kv_cache_dtype="int8" the pages are C8 (attention/sparse_int8_cache.py): the index keys are written
Hadamard-rotated int8 with their scales, and the queries rotated and quantized the same way before scoring.

Without metadata (profiling/dummy runs) the given tokens are one causal sequence and no cache is touched.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.attention import sparse_int8_cache
from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.sparse_mla_context_parallel import dcp_select_tokens, sparse_mla_context_parallel_attention
from pagedserve.attention.forward_context import get_forward_context, save_kv_layer
from pagedserve.attention.kv_cache_spec import ExtraKVComponent, KVCacheSpec
from pagedserve.attention.kv_page_layout import kv_cache_component
from pagedserve.attention.lightning_indexer import (
    INDEX_KEY_COMPONENT,
    select_tokens,
    select_tokens_in_sequence,
    write_index_keys,
)
from pagedserve.attention.sparse_int8_cache import SparseMLAKVCacheSpec
from pagedserve.attention.sparse_mla import DecodeRowGather, attend_selected_in_sequence, sparse_mla_attention
from pagedserve.layers.lightning_indexer import IndexerProjections
from pagedserve.layers.mla_attention import MLAAttention


class SparseMLAAttention(MLAAttention):
    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 kv_lora_rank: int, scale: float, kv_b_proj: nn.Module, *, index_topk: int,
                 index_head_dim: int | None, selection_source: SparseMLAAttention | None = None,
                 prefix: str = "") -> None:
        """`index_head_dim` None: a layer without an indexer, reusing `selection_source`'s selection."""
        super().__init__(num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank, scale, kv_b_proj,
                         prefix=prefix)
        if index_topk < 1:
            raise ValueError(f"{prefix}: index_topk={index_topk} must be >= 1")
        if (index_head_dim is None) == (selection_source is None):
            raise ValueError(f"{prefix}: a sparse MLA layer either runs its own indexer (index_head_dim) or reuses "
                             f"another layer's selection (selection_source), exactly one of them")
        self.index_topk = index_topk
        self.index_head_dim = index_head_dim
        self.index_softmax_scale = index_head_dim ** -0.5 if index_head_dim else 0.0
        # A plain list: the source is another layer's module, not a submodule of this one.
        self._selection_source = [selection_source] if selection_source is not None else []
        # This step's selection [num_tokens, width] (positions, -1 padded), for the layers sharing it.
        self.latest_selection: torch.Tensor | None = None
        # Where decodes read their selected latent rows; None: the cache. Sparse KV offload sets it
        # (sparse_kv_offload/offload_manager.py).
        self.decode_row_gather: DecodeRowGather | None = None

    @property
    def has_indexer(self) -> bool:
        return self.index_head_dim is not None

    def kv_cache_spec(self) -> KVCacheSpec:
        """The latent row per token, plus (with an indexer) the index key row in the same page; the C8 page under
        kv_cache_dtype="int8"."""
        extra = (ExtraKVComponent(INDEX_KEY_COMPONENT, (self.index_head_dim,)),) if self.has_indexer else ()
        return SparseMLAKVCacheSpec(per_token_shape=(self.kv_lora_rank + self.qk_rope_head_dim,),
                                    supports_int8=True, latent_rank=self.kv_lora_rank, extra_components=extra,
                                    index_head_dim=self.index_head_dim)

    def _shared_selection(self, num_tokens: int) -> torch.Tensor:
        selection = self._selection_source[0].latest_selection
        if selection is None or selection.shape[0] != num_tokens:
            raise RuntimeError(f"{self.layer_name}: the layer it shares top-k selections with has none for this "
                               f"step (it must run first in the same forward)")
        return selection

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                index: IndexerProjections | None = None) -> torch.Tensor:
        """As MLAAttention.forward, with `index` the indexer's projections of these tokens (None for a layer that
        reuses another's selection)."""
        if self.has_indexer != (index is not None):
            raise ValueError(f"{self.layer_name}: index projections must be given exactly when the layer has an "
                             f"indexer")
        latent = torch.cat([kv_c_normed, k_pe], dim=-1)
        kv_b_weight = self._kv_b_proj[0].weight
        metadata = get_forward_context().attn_metadata
        step = metadata.context_parallel if metadata is not None else None
        if step is not None:
            # Prefill context parallel: the indexer and the attention see the step's tokens, not this rank's run of
            # them (identities otherwise); the context-parallel attention returns this rank's rows.
            q_nope, q_pe, latent = step.gather_tokens(q_nope), step.gather_tokens(q_pe), step.gather_tokens(latent)
            if index is not None:
                index = IndexerProjections(step.gather_tokens(index.query), step.gather_tokens(index.key),
                                           step.gather_tokens(index.weights))
        num_tokens = q_nope.shape[0]
        if metadata is None:
            if index is not None:
                selection = select_tokens_in_sequence(index.query, index.weights, index.key, self.index_topk,
                                                      self.index_softmax_scale)
            else:
                selection = self._shared_selection(num_tokens)
            self.latest_selection = selection
            output = attend_selected_in_sequence(q_nope, q_pe, latent, selection, kv_b_weight, self.kv_lora_rank,
                                                 self.v_head_dim, self.scale)
        else:
            if self.kv_cache is None:
                raise RuntimeError(f"{self.layer_name}: attention metadata is set but no kv_cache is bound")
            if index is not None:
                selection = self._select(index, metadata)
            else:
                selection = self._shared_selection(num_tokens)
            self.latest_selection = selection
            if metadata.context_parallel is not None:
                output = sparse_mla_context_parallel_attention(q_nope, q_pe, latent, self.kv_cache, metadata,
                                                               selection, kv_b_weight, self.kv_lora_rank,
                                                               self.v_head_dim, self.scale)
            else:
                output = sparse_mla_attention(q_nope, q_pe, latent, self.kv_cache, metadata, selection, kv_b_weight,
                                              self.kv_lora_rank, self.v_head_dim, self.scale,
                                              gather_decode_rows=self.decode_row_gather)
            save_kv_layer(self.layer_name, self.kv_cache)  # the page's latent and index keys are written
        return output.reshape(output.shape[0], self.num_heads * self.v_head_dim)

    def _select(self, index: IndexerProjections, metadata: AttentionMetadata) -> torch.Tensor:
        """Write this step's index keys, then select every token's top-k positions (over the DCP group's keys
        when decode context parallel splits them: only this rank's tokens are written, at its local slots)."""
        num_actual = metadata.num_actual_tokens
        keys = index.key[:num_actual]
        if metadata.context_parallel is None:
            slots = metadata.slot_mapping[:num_actual]
            select = select_tokens
        else:
            keys, slots = keys[metadata.context_parallel.local_token_indices], metadata.slot_mapping
            select = dcp_select_tokens
        if sparse_int8_cache.is_sparse_int8_cache(self.kv_cache):
            sparse_int8_cache.write_index_keys(keys, self.kv_cache, slots)
            key_cache, key_scales = sparse_int8_cache.index_key_caches(self.kv_cache)
            query, weights = sparse_int8_cache.quantize_index_query(index.query, index.weights)
            return select(query, weights, key_cache, metadata, self.index_topk, self.index_softmax_scale,
                          key_scale_cache=key_scales)
        key_cache = kv_cache_component(self.kv_cache, INDEX_KEY_COMPONENT)
        write_index_keys(keys, key_cache, slots)
        return select(index.query, index.weights, key_cache, metadata, self.index_topk, self.index_softmax_scale)

    def extra_repr(self) -> str:
        source = "own indexer" if self.has_indexer else f"shares {self._selection_source[0].layer_name}"
        return f"{super().extra_repr()}, index_topk={self.index_topk}, {source}"


__all__ = ["SparseMLAAttention"]
