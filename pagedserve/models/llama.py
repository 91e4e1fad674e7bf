"""Llama family decoder (also the base of Mistral, Qwen2 and Qwen3).

HF parameter names are kept (model.embed_tokens, model.layers.N.self_attn.{q,k,v,o}_proj,
model.layers.N.mlp.{gate,up,down}_proj, model.layers.N.{input,post_attention}_layernorm, model.norm,
lm_head); q/k/v and gate/up are fused at load time through `packed_modules_mapping`.
"""
from __future__ import annotations

from itertools import islice
from typing import Any, Iterable

import torch
from torch import nn

from pagedserve.distributed import get_embedding_tp_group, get_lmhead_tp_group
from pagedserve.distributed.pipeline_comm import IntermediateTensors
from pagedserve.layers.activation import SiluAndMul
from pagedserve.layers.amx_gate_up_silu import fused_gate_up_silu_and_mul
from pagedserve.layers.attention import Attention
from pagedserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.output_projection import AttentionOutputProjection
from pagedserve.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from pagedserve.layers.weight_loading import default_weight_loader
from pagedserve.models.pipeline_split import PipelineMissingLayer, PipelineStage, make_stage_layers, stage_weights


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
        # Prefill-sized bf16 batches on the tile-packed layout: both in one native pass (layers/amx_gate_up_silu.py).
        activated = fused_gate_up_silu_and_mul(self.gate_up_proj, self.act_fn, x)
        if activated is None:
            activated = self.act_fn(self.gate_up_proj(x))
        return self.down_proj(activated)


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
        self.qkv_split_sizes = [self.q_size, self.kv_size, self.kv_size]
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
        # split_with_sizes: the same views as Tensor.split without its Python wrapper (once per layer).
        query, key, value = qkv.split_with_sizes(self.qkv_split_sizes, dim=-1)
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
    """Embedding, decoder layers and final norm — of this process's pipeline stage only: the embedding on
    the first stage, the final norm on the last, the stage's layer range (models/pipeline_split.py);
    the other positions hold parameter-free placeholders."""

    def __init__(self, hf_config: Any, attention_class: type[LlamaAttention], *, params_dtype: torch.dtype,
                 prefix: str = "model") -> None:
        super().__init__()
        self.stage = PipelineStage.current(int(hf_config.num_hidden_layers))
        self.embed_tokens = (VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size,
                                                    params_dtype=params_dtype, group=get_embedding_tp_group(),
                                                    prefix=f"{prefix}.embed_tokens")
                             if self.stage.is_first else PipelineMissingLayer())
        rotary_emb = get_rope(config_head_dim(hf_config), int(hf_config.max_position_embeddings),
                              rope_parameters_from_config(hf_config))
        self.rotary_emb = rotary_emb  # shared by every layer's attention
        self.layers = make_stage_layers(
            int(hf_config.num_hidden_layers), self.stage,
            lambda index: LlamaDecoderLayer(hf_config, index, rotary_emb, attention_class, params_dtype=params_dtype,
                                            prefix=f"{prefix}.layers.{index}"))
        self.norm = (RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, params_dtype=params_dtype)
                     if self.stage.is_last else PipelineMissingLayer())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """Final hidden states on the last pipeline stage; the stage's IntermediateTensors on the others
        (a stage after the first starts from the previous stage's `intermediate_tensors`)."""
        self.rotary_emb.clear_memo()
        residual: torch.Tensor | None = None
        if intermediate_tensors is None:
            hidden_states = self.embed_tokens(input_ids)
        else:
            hidden_states, residual = intermediate_tensors.hidden_states, intermediate_tensors.residual
        for layer in islice(self.layers, self.stage.start_layer, self.stage.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not self.stage.is_last:
            return IntermediateTensors(hidden_states=hidden_states, residual=residual)
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
        self.attach_lm_head(hf_config, dtype, group=get_lmhead_tp_group())

    def attach_lm_head(self, hf_config: Any, dtype: torch.dtype, **head_kwargs: Any) -> None:
        """The LM head on the last pipeline stage (a placeholder elsewhere). Tied embeddings share one
        parameter when one stage holds both ends; otherwise the last stage's head loads the embedding's
        checkpoint tensor (pipeline_split.stage_weights)."""
        stage: PipelineStage = self.model.stage
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # True when lm_head.weight is model.embed_tokens.weight itself (a single-stage tied model).
        self.lm_head_is_tied = self.tie_word_embeddings and stage.is_first and stage.is_last
        if not stage.is_last:
            self.lm_head = PipelineMissingLayer()
            return
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, params_dtype=dtype,
                                      prefix="lm_head", **head_kwargs)
        if self.lm_head_is_tied:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """[n, hidden] -> logits [n, vocab_size], float32 by default; dtype=None keeps the model's dtype."""
        return self.lm_head.compute_logits(hidden_states, dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load (HF name, tensor) pairs; return the names of the parameters now fully loaded.

        Tensors of modules other pipeline stages hold are skipped unread. A fused parameter counts as
        loaded once every one of its shards has arrived. Unknown names raise ValueError (a checkpoint
        that does not match the architecture should not load silently).
        """
        return self.load_stage_weights(self.stage_weights(weights))

    def stage_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The part of the checkpoint stream this pipeline stage loads (everything on a single stage)."""
        return stage_weights(weights, self.model.stage, int(self.config.num_hidden_layers),
                             self.tie_word_embeddings)

    def load_stage_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """load_weights on a stream already cut to this stage (stage_weights)."""
        params = dict(self.named_parameters())
        fused_shard_ids = {fused: set(range(len(parts))) for fused, parts in self.packed_modules_mapping.items()}
        seen_shards: dict[str, set[int]] = {}
        loaded: set[str] = set()
        for name, loaded_weight in weights:
            if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name or "rotary_emb.sin_cached" in name:
                continue  # derived buffers some checkpoints carry
            if self.lm_head_is_tied and name.startswith("lm_head."):
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
