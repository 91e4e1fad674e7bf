"""Llama family decoder (also the base of Mistral, Qwen2 and Qwen3).

HF parameter names are kept (model.embed_tokens, model.layers.N.self_attn.{q,k,v,o}_proj,
model.layers.N.mlp.{gate,up,down}_proj, model.layers.N.{input,post_attention}_layernorm, model.norm,
lm_head); q/k/v and gate/up are fused at load time through `packed_modules_mapping`.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from pagedserve.distributed import get_embedding_tp_group, get_lmhead_tp_group
from pagedserve.layers.activation import SiluAndMul
from pagedserve.layers.attention import Attention
from pagedserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.output_projection import AttentionOutputProjection
from pagedserve.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from pagedserve.layers.weight_loading import default_weight_loader


def config_head_dim(hf_config: Any) -> int:
    """head_dim from the config when given (Qwen3, some Mistrals), else hidden_size / num_attention_heads."""
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim) if head_dim else hf_config.hidden_size // hf_config.num_attention_heads


def layer_sliding_window(hf_config: Any, layer_index: int) -> int | None:
    """The sliding window of one layer: per `layer_types` when the config lists them, else global."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return int(window) if layer_types[layer_index] == "sliding_attention" else None
    return int(window)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool, params_dtype: torch.dtype,
                 prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                       params_dtype=params_dtype, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, params_dtype=params_dtype,
                                           prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Self-attention with fused QKV, RoPE and GQA; subclasses adjust biases and q/k normalisation."""

    @classmethod
    def projection_biases(cls, hf_config: Any) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj)."""
        bias = bool(getattr(hf_config, "attention_bias", False))
        return bias, bias

    def __init__(self, hf_config: Any, layer_index: int, rotary_emb: RotaryEmbedding, *,
                 params_dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.hidden_size = hf_config.hidden_size
        self.total_num_heads = hf_config.num_attention_heads
        self.total_num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or self.total_num_heads
        self.head_dim = config_head_dim(hf_config)
        qkv_bias, o_proj_bias = self.projection_biases(hf_config)
        self.qkv_proj = QKVParallelLinear(self.hidden_size, self.head_dim, self.total_num_heads,
                                          self.total_num_kv_heads, bias=qkv_bias, params_dtype=params_dtype,
                                          prefix=f"{prefix}.qkv_proj")
        # Per-rank head counts come from the fused projection, which knows the TP split.
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = AttentionOutputProjection(self.total_num_heads * self.head_dim, self.hidden_size,
                                                bias=o_proj_bias, params_dtype=params_dtype,
                                                prefix=f"{prefix}.o_proj")
        # Shared across layers: the module is registered in every layer but holds one table.
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads,
                              sliding_window=layer_sliding_window(hf_config, layer_index), prefix=f"{prefix}.attn")

    def normalize_query_key(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook before RoPE (identity for Llama; per-head RMSNorm for Qwen3)."""
        return query, key

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query, key = self.normalize_query_key(query, key)
        query, key = self.rotary_emb(positions, query, key)
        return self.o_proj(self.attn(query, key, value))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, layer_index: int, rotary_emb: RotaryEmbedding,
                 attention_class: type[LlamaAttention], *, params_dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.self_attn = attention_class(hf_config, layer_index, rotary_emb, params_dtype=params_dtype,
                                         prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size,
                            bias=bool(getattr(hf_config, "mlp_bias", False)), params_dtype=params_dtype,
                            prefix=f"{prefix}.mlp")
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, params_dtype=params_dtype)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, params_dtype=params_dtype)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add of the previous sub-block is fused into the next norm.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.feed_forward(hidden_states), residual

    def feed_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The MLP sub-block (MoE layers override it: their MLP may carry another HF name)."""
        return self.mlp(hidden_states)


class LlamaModel(nn.Module):
    def __init__(self, hf_config: Any, attention_class: type[LlamaAttention], *, params_dtype: torch.dtype,
                 prefix: str = "model") -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size,
                                                   params_dtype=params_dtype, group=get_embedding_tp_group(),
                                                   prefix=f"{prefix}.embed_tokens")
        rotary_emb = get_rope(config_head_dim(hf_config), int(hf_config.max_position_embeddings),
                              rope_parameters_from_config(hf_config))
        self.rotary_emb = rotary_emb  # shared by every layer's attention
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, index, rotary_emb, attention_class, params_dtype=params_dtype,
                              prefix=f"{prefix}.layers.{index}")
            for index in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, params_dtype=params_dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.rotary_emb.clear_memo()
        hidden_states = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if residual is None:  # no layers
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Causal LM over flat token batches: forward(input_ids[n], positions[n]) -> hidden_states[n, hidden]."""

    attention_class: type[LlamaAttention] = LlamaAttention
    # Fused parameter -> the checkpoint's separate parameters, in shard order.
    packed_modules_mapping: dict[str, list[str]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    # (fused name, checkpoint name, shard id) used by load_weights.
    stacked_params_mapping: list[tuple[str, str, str | int]] = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.model = LlamaModel(hf_config, self.attention_class, params_dtype=dtype, prefix="model")
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, params_dtype=dtype,
                                      group=get_lmhead_tp_group(), prefix="lm_head")
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> float32 logits [n, vocab_size]."""
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load (HF name, tensor) pairs; return the names of the parameters now fully loaded.

        A fused parameter counts as loaded once every one of its shards has arrived. Unknown names
        raise ValueError (a checkpoint that does not match the architecture should not load silently).
        """
        params = dict(self.named_parameters())
        fused_shard_ids = {fused: set(range(len(parts))) for fused, parts in self.packed_modules_mapping.items()}
        seen_shards: dict[str, set[int]] = {}
        loaded: set[str] = set()
        for name, loaded_weight in weights:
            if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name or "rotary_emb.sin_cached" in name:
                continue  # derived buffers some checkpoints carry
            if self.tie_word_embeddings and name.startswith("lm_head."):
                continue  # the head shares model.embed_tokens.weight
            for fused, checkpoint_name, shard_id in self.stacked_params_mapping:
                if f".{checkpoint_name}." not in name:
                    continue
                param_name = name.replace(f".{checkpoint_name}.", f".{fused}.")
                param = self._parameter(params, param_name, name)
                param.weight_loader(param, loaded_weight, shard_id)
                part_index = self.packed_modules_mapping[fused].index(checkpoint_name)
                seen = seen_shards.setdefault(param_name, set())
                seen.add(part_index)
                if seen == fused_shard_ids[fused]:
                    loaded.add(param_name)
                break
            else:
                param = self._parameter(params, name, name)
                weight_loader = getattr(param, "weight_loader", default_weight_loader)
                weight_loader(param, loaded_weight)
                loaded.add(name)
        return loaded

    @staticmethod
    def _parameter(params: dict[str, nn.Parameter], param_name: str, checkpoint_name: str) -> nn.Parameter:
        if param_name not in params:
            raise ValueError(f"checkpoint tensor {checkpoint_name!r} matches no parameter of the model "
                             f"(looked for {param_name!r})")
        return params[param_name]
