"""Shared pieces of the MoE decoders: the sparse MoE block, a decoder layer/model with per-layer attention
and MLP choices, and checkpoint loading of HF per-expert tensors into stacked expert parameters.

HF names are kept: `model.layers.N.mlp.gate.weight` (router), `model.layers.N.mlp.experts.E.{gate,up,down}_proj
.weight` (Mixtral: `block_sparse_moe.experts.E.w{1,3,2}.weight`), `...mlp.shared_expert(s).*`. The experts'
per-expert tensors load into `...experts.w13_weight` / `...experts.w2_weight` (stacked) through the
FusedMoE weight loader.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.embedding import VocabParallelEmbedding
from pagedserve.layers.linear import ReplicatedLinear
from pagedserve.layers.moe.fused_moe import FusedMoE
from pagedserve.layers.moe.moe_options import current_moe_options
from pagedserve.layers.moe.shared_expert_overlap import SharedExpertOverlap
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from pagedserve.models.pipeline_split import PipelineMissingLayer, PipelineStage, make_stage_layers

# checkpoint projection name -> FusedMoE shard id
EXPERT_SHARDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2"}
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
# `field`: the weight, or its per-channel scale in a W8A8 checkpoint.
_EXPERT_NAME = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<projection>\w+)\.(?P<field>weight|weight_scale)$")


class SparseMoeBlock(nn.Module):
    """Router (`gate`) + routed experts (`experts`, a FusedMoE) + optional shared expert(s).

    `shared_expert_name` keeps the HF name ('shared_experts' for DeepSeek/GLM, 'shared_expert' for Qwen2-MoE);
    Qwen2-MoE also scales the shared output by sigmoid(shared_expert_gate(x)).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, moe_intermediate_size: int, *,
                 params_dtype: torch.dtype, prefix: str, router_in_float32: bool = False,
                 shared_intermediate_size: int = 0, shared_expert_name: str = "shared_experts",
                 has_shared_expert_gate: bool = False, **routing: Any) -> None:
        super().__init__()
        self.router_in_float32 = router_in_float32
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False,
                                     params_dtype=torch.float32 if router_in_float32 else params_dtype,
                                     prefix=f"{prefix}.gate")
        # The float32 router path reads gate.weight itself (routed()): it keeps the plain layout.
        self.gate.weight_read_elsewhere = router_in_float32
        self.experts = FusedMoE(num_experts, top_k, hidden_size, moe_intermediate_size, params_dtype=params_dtype,
                                prefix=f"{prefix}.experts", **routing)
        self.shared_expert_name = shared_expert_name if shared_intermediate_size else None
        if shared_intermediate_size:
            setattr(self, shared_expert_name, LlamaMLP(hidden_size, shared_intermediate_size, bias=False,
                                                       params_dtype=params_dtype,
                                                       prefix=f"{prefix}.{shared_expert_name}"))
        self.shared_expert_gate = (ReplicatedLinear(hidden_size, 1, bias=False, params_dtype=params_dtype,
                                                    prefix=f"{prefix}.shared_expert_gate")
                                   if has_shared_expert_gate else None)
        self.overlap = SharedExpertOverlap(current_moe_options().multistream_overlap_shared_expert)

    def routed(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.router_in_float32:
            router_logits = F.linear(hidden_states.float(), self.gate.weight.float())
        else:
            router_logits = self.gate(hidden_states)
        return self.experts(hidden_states, router_logits)

    def shared(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output = getattr(self, self.shared_expert_name)(hidden_states)
        if self.shared_expert_gate is not None:
            output = torch.sigmoid(self.shared_expert_gate(hidden_states)) * output
        return output

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.shared_expert_name is None:
            return self.routed(hidden_states)
        shared_output, routed_output = self.overlap.run(hidden_states, self.shared, self.routed)
        return routed_output + shared_output


class MoeDecoderLayer(LlamaDecoderLayer):
    """Pre-norm decoder layer with any attention block and any MLP (dense or sparse); Llama's forward."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float,
                 params_dtype: torch.dtype, mlp_name: str = "mlp") -> None:
        # LlamaDecoderLayer.__init__ builds Llama's own blocks: the given ones are set here instead.
        nn.Module.__init__(self)
        self.self_attn = self_attn
        # The HF name of the MLP ('mlp'; Mixtral: 'block_sparse_moe').
        self.mlp_name = mlp_name
        setattr(self, mlp_name, mlp)
        self.input_layernorm = RMSNorm(hidden_size, eps, params_dtype=params_dtype)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, params_dtype=params_dtype)

    def feed_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.mlp_name)(hidden_states)


# (hf_config, layer_index, rotary_emb, params_dtype, prefix) -> module
ModuleFactory = Callable[[Any, int, RotaryEmbedding, torch.dtype, str], nn.Module]


class MoeModel(LlamaModel):
    """LlamaModel's forward over layers built by the family's attention and MLP factories."""

    def __init__(self, hf_config: Any, rotary_emb: RotaryEmbedding, attention_factory: ModuleFactory,
                 mlp_factory: ModuleFactory, *, params_dtype: torch.dtype, prefix: str = "model",
                 mlp_name: str = "mlp") -> None:
        # LlamaModel.__init__ builds dense Llama layers: the same attributes are set up here instead.
        # Like LlamaModel, only this pipeline stage's share is built (models/pipeline_split.py).
        nn.Module.__init__(self)
        self.stage = PipelineStage.current(int(hf_config.num_hidden_layers))
        self.embed_tokens = (VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size,
                                                    params_dtype=params_dtype, prefix=f"{prefix}.embed_tokens")
                             if self.stage.is_first else PipelineMissingLayer())
        self.rotary_emb = rotary_emb
        self.layers = make_stage_layers(
            int(hf_config.num_hidden_layers), self.stage,
            lambda index: MoeDecoderLayer(
                attention_factory(hf_config, index, rotary_emb, params_dtype, f"{prefix}.layers.{index}.self_attn"),
                mlp_factory(hf_config, index, rotary_emb, params_dtype, f"{prefix}.layers.{index}.{mlp_name}"),
                hf_config.hidden_size, hf_config.rms_norm_eps, params_dtype, mlp_name))
        self.norm = (RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, params_dtype=params_dtype)
                     if self.stage.is_last else PipelineMissingLayer())



class MoeForCausalLM(LlamaForCausalLM):
    """Base of the MoE causal LMs: a MoeModel built from the subclass's factories, Llama's head and loader,
    plus the per-expert checkpoint tensors routed into the stacked FusedMoE parameters."""

    # Checkpoint name fragment -> parameter name fragment (e.g. DeepSeek's router bias lives on the experts).
    renamed_params: dict[str, str] = {".gate.e_score_correction_bias": ".experts.e_score_correction_bias"}
    mlp_name = "mlp"

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32) -> None:
        # LlamaForCausalLM.__init__ would build a dense LlamaModel: set up the same attributes here instead.
        nn.Module.__init__(self)
        self.config = hf_config
        self.dtype = dtype
        self.model = MoeModel(hf_config, self.build_rotary_embedding(hf_config), self.build_attention,
                              self.build_mlp, params_dtype=dtype, prefix="model", mlp_name=self.mlp_name)
        self.attach_lm_head(hf_config, dtype)

    # ---- per-family hooks -----------------------------------------------------------------------
    def build_rotary_embedding(self, hf_config: Any) -> RotaryEmbedding:
        raise NotImplementedError

    def build_attention(self, hf_config: Any, layer_index: int, rotary_emb: RotaryEmbedding,
                        params_dtype: torch.dtype, prefix: str) -> nn.Module:
        raise NotImplementedError

    def build_mlp(self, hf_config: Any, layer_index: int, rotary_emb: RotaryEmbedding,
                  params_dtype: torch.dtype, prefix: str) -> nn.Module:
        raise NotImplementedError

    # ---- loading --------------------------------------------------------------------------------
    def moe_layers(self) -> list[FusedMoE]:
        return [module for module in self.modules() if isinstance(module, FusedMoE)]

    def loads_layer(self, layer_index: int) -> bool:
        """Whether checkpoint layer `layer_index` is this model's: the decoder's, not the multi-token-prediction
        layers stored after it (DeepSeek-V3, GLM-4.5), which the MTP drafter loads."""
        return layer_index < int(self.config.num_hidden_layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Cut to this pipeline stage first: expert tensors of layers another stage holds are never read.
        weights = self.stage_weights(weights)
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        num_shards_seen: dict[str, int] = {}

        def non_expert_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                layer = _LAYER_INDEX.match(name)
                if layer and not self.loads_layer(int(layer[1])):
                    continue
                match = _EXPERT_NAME.match(name)
                if match and match["projection"] in EXPERT_SHARDS:
                    shard_id = EXPERT_SHARDS[match["projection"]]
                    param_name = (f"{match['prefix']}.{'w2' if shard_id == 'w2' else 'w13'}_"
                                  f"{match['field']}")
                    param = self._parameter(params, param_name, name)
                    param.weight_loader(param, tensor, shard_id, int(match["expert"]))
                    # w13 needs gate and up of every expert, w2 the down of every expert.
                    num_shards_seen[param_name] = num_shards_seen.get(param_name, 0) + 1
                    module = self.get_submodule(match["prefix"])
                    needed = module.num_logical_experts * (1 if shard_id == "w2" else 2)
                    if num_shards_seen[param_name] == needed:
                        loaded.add(param_name)
                    continue
                for old, new in self.renamed_params.items():
                    name = name.replace(old, new)
                yield name, tensor

        loaded |= self.load_stage_weights(non_expert_weights())
        return loaded
