"""DFlash block drafter (speculative method 'dflash'), in the DFlash checkpoint layout (Qwen3-style layers).

Checkpoint tensors (an optional leading 'model.' is ignored): fc.weight [H, n * H_target] over the outputs of the
n target layers `target_layer_ids`, hidden_norm.weight, layers.N.* Qwen3 decoder layers (q/k/v/o_proj, q_norm,
k_norm, mlp, input / post_attention layernorms), norm.weight, and optionally lm_head.weight (over a draft
vocabulary of draft_vocab_size ids, mapped to target ids by d2t), embed_tokens.weight (else the target's).
config.json: `target_layer_ids` and `mask_token_id`, under `dflash_config` or at the top level.

Context: the target layers' outputs at every position the target computed go through fc and hidden_norm, and
each layer's k/v projections (with k_norm and RoPE at the context position) write them into the layer's cache.
Draft: one forward over [anchor (the last emitted token), mask x K] at the positions from the anchor's on, each
row attending the request's context and its whole block; row j (1..K) predicts the token at its own position.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from pagedserve.distributed import get_lmhead_tp_group
from pagedserve.layers.block_draft_attention import BlockDraftAttention
from pagedserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.linear import ReplicatedLinear
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import get_rope, rope_parameters_from_config
from pagedserve.models.hidden_state_drafter import HiddenStateDrafter
from pagedserve.models.llama import LlamaDecoderLayer, config_head_dim
from pagedserve.models.qwen3 import Qwen3Attention

_REQUIRED = object()


def block_drafter_setting(hf_config: Any, name: str, default: Any = _REQUIRED) -> Any:
    """A DFlash / DSpark setting from `dflash_config` or the top level of the drafter's config.json."""
    nested = getattr(hf_config, "dflash_config", None) or {}
    if name in nested:
        return nested[name]
    value = getattr(hf_config, name, None)
    if value is not None:
        return value
    if default is _REQUIRED:
        raise ValueError(f"the drafter's config.json has no {name!r} (at the top level or under dflash_config)")
    return default


class DFlashQwen3ForCausalLM(HiddenStateDrafter):
    # The target's hidden states come as the outputs of `target_layer_ids` (-1: the embedding), not the inputs.
    reads_layer_outputs = True

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, *,
                 checkpoint_names: frozenset[str] = frozenset(), target_num_layers: int) -> None:
        super().__init__(hf_config, dtype, checkpoint_names)
        hidden_size = hf_config.hidden_size
        self.init_vocab_map(hf_config)
        layer_ids = tuple(int(index) for index in block_drafter_setting(hf_config, "target_layer_ids"))
        if not layer_ids or not all(-1 <= index < target_num_layers for index in layer_ids):
            raise ValueError(f"target_layer_ids={list(layer_ids)} must be layer indices in [-1, {target_num_layers}) "
                             f"of the target model (-1: its embedding output)")
        self.aux_hidden_state_layer_ids = layer_ids
        self.mask_token_id = int(block_drafter_setting(hf_config, "mask_token_id"))
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} must be a token id in [0, {self.vocab_size})")
        target_hidden_size = int(getattr(hf_config, "target_hidden_size", None) or hidden_size)
        self.fc = ReplicatedLinear(len(layer_ids) * target_hidden_size, hidden_size, bias=False, params_dtype=dtype,
                                   prefix="fc")
        self.hidden_norm = RMSNorm(hidden_size, hf_config.rms_norm_eps, params_dtype=dtype)
        if "embed_tokens.weight" in self.checkpoint_tensor_names:
            self.embed_tokens = VocabParallelEmbedding(self.vocab_size, hidden_size, params_dtype=dtype,
                                                       prefix="embed_tokens")
        self.rotary_emb = get_rope(config_head_dim(hf_config), int(hf_config.max_position_embeddings),
                                   rope_parameters_from_config(hf_config))
        layers = []
        for index in range(int(hf_config.num_hidden_layers)):
            layer = LlamaDecoderLayer(hf_config, index, self.rotary_emb, Qwen3Attention, params_dtype=dtype,
                                      prefix=f"drafter.layers.{index}")
            attention = layer.self_attn
            attention.attn = BlockDraftAttention(attention.num_heads, attention.head_dim, attention.head_dim ** -0.5,
                                                 attention.num_kv_heads, prefix=f"drafter.layers.{index}.attn")
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, hf_config.rms_norm_eps, params_dtype=dtype)
        if "lm_head.weight" in self.checkpoint_tensor_names:
            self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden_size, params_dtype=dtype, prefix="lm_head",
                                          group=get_lmhead_tp_group())
        elif self.draft_vocab_size != self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} differs from vocab_size={self.vocab_size} "
                             f"but the checkpoint has no lm_head.weight (the target's head covers the full vocabulary)")

    # ---- context -------------------------------------------------------------------------------
    def combine_hidden_states(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, len(target_layer_ids) * target hidden] -> the context states [n, hidden]."""
        return self.hidden_norm(self.fc(target_hidden_states.to(self.dtype)))

    def write_context(self, context_states: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Every layer's K (k_norm, RoPE) and V of the context states, into its cache at `slot_mapping`."""
        self.rotary_emb.clear_memo()
        num_tokens = context_states.shape[0]
        for layer in self.layers:
            attention = layer.self_attn
            _, key, value = attention.qkv_proj(context_states).split_with_sizes(attention.qkv_split_sizes, dim=-1)
            key = attention.k_norm(key.reshape(num_tokens, attention.num_kv_heads, attention.head_dim))
            key = key.reshape(num_tokens, attention.kv_size)
            _, key = attention.rotary_emb(positions, key, key)
            attention.attn.write_context(key, value, slot_mapping)

    # ---- the draft block -----------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                hidden_states: torch.Tensor | None = None, step_index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The block rows (under BlockDraftMetadata) -> their final hidden states (twice: the interface's pair)."""
        self.rotary_emb.clear_memo()
        hidden = self.embed(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        assert residual is not None
        normed, _ = self.norm(hidden, residual)
        return normed, normed

    def compute_draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (the full one without a vocabulary map), float32."""
        head = self._modules.get("lm_head") or self.target_lm_head
        assert head is not None, "attach_target() before the first forward"
        return head.compute_logits(hidden_states, torch.float32)

    def compute_logits(self, hidden_states: torch.Tensor,  # type: ignore[override]
                       step_index: int = 0) -> torch.Tensor:
        return self.to_target_vocab(self.compute_draft_logits(hidden_states))

    # ---- loading -------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return self.load_vocab_mapped_weights(weights)


__all__ = ["DFlashQwen3ForCausalLM", "block_drafter_setting"]
