"""Random hidden-state drafter checkpoints in their published layouts, for a tiny target folder:
EAGLE (config.json + fc / layers.0.* / embed_tokens, safetensors or pytorch_model.bin), EAGLE-3 (fc [H, 3H],
midlayer.*, norm, lm_head over a draft vocabulary, d2t / t2d), and MTP layers appended to a DeepSeek-V3 /
GLM-4.5 checkpoint (model.layers.{L}.{enorm, hnorm, eh_proj, shared_head.*, embed_tokens} + a decoder layer)."""
from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def _target(folder: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    with open(os.path.join(folder, "config.json")) as handle:
        config = json.load(handle)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="pt") as handle:
                tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return config, tensors


def edit_config(folder: str, **changes: Any) -> None:
    """Rewrite keys of a checkpoint folder's config.json (a drafter made for another target, ...)."""
    path = os.path.join(folder, "config.json")
    with open(path) as handle:
        config = json.load(handle)
    config.update(changes)
    with open(path, "w") as handle:
        json.dump(config, handle)


def _llama_layer(prefix: str, config: dict[str, Any], generator: torch.Generator, qkv_input: int,
                 with_input_norm: bool = True, scale: float = 0.2) -> dict[str, torch.Tensor]:
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    inter = config["intermediate_size"]

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    tensors = {
        f"{prefix}.self_attn.q_proj.weight": random(heads * head_dim, qkv_input),
        f"{prefix}.self_attn.k_proj.weight": random(kv_heads * head_dim, qkv_input),
        f"{prefix}.self_attn.v_proj.weight": random(kv_heads * head_dim, qkv_input),
        f"{prefix}.self_attn.o_proj.weight": random(hidden, heads * head_dim),
        f"{prefix}.mlp.gate_proj.weight": random(inter, hidden),
        f"{prefix}.mlp.up_proj.weight": random(inter, hidden),
        f"{prefix}.mlp.down_proj.weight": random(hidden, inter),
        f"{prefix}.post_attention_layernorm.weight": 1 + random(hidden),
    }
    if with_input_norm:
        tensors[f"{prefix}.input_layernorm.weight"] = 1 + random(hidden)
    return tensors


def write_eagle_checkpoint(folder: str, target_folder: str, *, seed: int = 0, as_bin: bool = False,
                           fc_bias: bool = True) -> str:
    """An EAGLE drafter for `target_folder` (a tiny llama): one layer, no input norm on it, fc [H, 2H]."""
    config, target = _target(target_folder)
    generator = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    tensors = _llama_layer("layers.0", config, generator, hidden, with_input_norm=False)
    tensors["fc.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.2
    if fc_bias:
        tensors["fc.bias"] = torch.randn(hidden, generator=generator) * 0.1
    tensors["embed_tokens.weight"] = target["model.embed_tokens.weight"].clone()
    os.makedirs(folder, exist_ok=True)
    drafter_config = dict(config, num_hidden_layers=1, architectures=["LlamaForCausalLM"])
    with open(os.path.join(folder, "config.json"), "w") as handle:
        json.dump(drafter_config, handle)
    if as_bin:
        torch.save(tensors, os.path.join(folder, "pytorch_model.bin"))
    else:
        save_file(tensors, os.path.join(folder, "model.safetensors"))
    return folder


def write_eagle3_checkpoint(folder: str, target_folder: str, *, seed: int = 0, draft_vocab_size: int | None = None,
                            aux_layer_ids: tuple[int, ...] = (0, 1, 1), with_embedding: bool = False,
                            drop: tuple[str, ...] = ()) -> str:
    """An EAGLE-3 drafter for `target_folder`: midlayer over [embed, hidden] (2H), fc over 3 aux hidden states,
    a draft vocabulary of `draft_vocab_size` ids (every other target id) mapped back by d2t."""
    config, target = _target(target_folder)
    generator = torch.Generator().manual_seed(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    tensors = _llama_layer("midlayer", config, generator, 2 * hidden)
    tensors["midlayer.hidden_norm.weight"] = 1 + torch.randn(hidden, generator=generator) * 0.2
    tensors["fc.weight"] = torch.randn(hidden, 3 * hidden, generator=generator) * 0.2
    tensors["norm.weight"] = torch.ones(hidden)
    draft_vocab_size = draft_vocab_size or vocab
    target_ids = torch.arange(draft_vocab_size) * (vocab // draft_vocab_size)
    tensors["lm_head.weight"] = torch.randn(draft_vocab_size, hidden, generator=generator) * 2.0
    tensors["d2t"] = target_ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    tensors["t2d"] = t2d
    if with_embedding:
        tensors["embed_tokens.weight"] = target["model.embed_tokens.weight"].clone()
    for name in drop:
        del tensors[name]
    os.makedirs(folder, exist_ok=True)
    drafter_config = dict(config, num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"],
                          draft_vocab_size=draft_vocab_size, eagle_config={
                              "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)})
    with open(os.path.join(folder, "config.json"), "w") as handle:
        json.dump(drafter_config, handle)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    return folder


def add_mtp_layers(target_folder: str, *, seed: int = 0, drop: tuple[str, ...] = ()) -> str:
    """Append one MTP layer to a tiny DeepSeek-V3 / GLM-4.5 checkpoint (in a second safetensors file): the decoder
    part a copy of the last layer's tensors, plus random enorm / hnorm / eh_proj / shared head."""
    config, target = _target(target_folder)
    generator = torch.Generator().manual_seed(seed)
    num_layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    tensors = {mtp + name[len(last):]: tensor.clone() for name, tensor in target.items() if name.startswith(last)}
    tensors[mtp + "enorm.weight"] = 1 + torch.randn(hidden, generator=generator) * 0.2
    tensors[mtp + "hnorm.weight"] = 1 + torch.randn(hidden, generator=generator) * 0.2
    tensors[mtp + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.2
    tensors[mtp + "shared_head.norm.weight"] = torch.ones(hidden)
    tensors[mtp + "shared_head.head.weight"] = torch.randn(config["vocab_size"], hidden, generator=generator) * 2.0
    tensors[mtp + "embed_tokens.weight"] = target["model.embed_tokens.weight"].clone()
    for name in drop:
        del tensors[mtp + name]
    save_file(tensors, os.path.join(target_folder, "model-mtp.safetensors"))
    config["num_nextn_predict_layers"] = 1
    with open(os.path.join(target_folder, "config.json"), "w") as handle:
        json.dump(config, handle)
    return target_folder


def write_dflash_checkpoint(folder: str, target_folder: str, *, seed: int = 0, target_layer_ids=(-1, 0, 1),
                            num_layers: int = 2, draft_vocab_size: int | None = None, dspark: bool = False,
                            markov_rank: int = 8, sample_from_anchor: bool = True,
                            with_confidence_head: bool = True) -> str:
    """A DFlash (or, with `dspark`, a DSpark) drafter for `target_folder`: Qwen3-style layers (q/k norms), fc over
    the outputs of `target_layer_ids`, hidden_norm, norm, an lm_head over a draft vocabulary mapped by d2t when
    `draft_vocab_size` is given (else the target's head is shared)."""
    config, target = _target(target_folder)
    generator = torch.Generator().manual_seed(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    head_dim = hidden // config["num_attention_heads"]
    tensors: dict[str, torch.Tensor] = {}
    for index in range(num_layers):
        tensors.update(_llama_layer(f"layers.{index}", config, generator, hidden))
        tensors[f"layers.{index}.self_attn.q_norm.weight"] = 1 + torch.randn(head_dim, generator=generator) * 0.2
        tensors[f"layers.{index}.self_attn.k_norm.weight"] = 1 + torch.randn(head_dim, generator=generator) * 0.2
    tensors["fc.weight"] = torch.randn(hidden, len(target_layer_ids) * hidden, generator=generator) * 0.2
    tensors["hidden_norm.weight"] = 1 + torch.randn(hidden, generator=generator) * 0.2
    tensors["norm.weight"] = torch.ones(hidden)
    draft_vocab = draft_vocab_size or vocab
    if draft_vocab_size is not None:
        target_ids = torch.arange(draft_vocab) * (vocab // draft_vocab)
        tensors["lm_head.weight"] = torch.randn(draft_vocab, hidden, generator=generator) * 2.0
        tensors["d2t"] = target_ids - torch.arange(draft_vocab)
    settings: dict[str, Any] = {"target_layer_ids": list(target_layer_ids), "mask_token_id": vocab - 1}
    if dspark:
        tensors["markov_head.markov_w1.weight"] = torch.randn(vocab, markov_rank, generator=generator)
        tensors["markov_head.markov_w2.weight"] = torch.randn(draft_vocab, markov_rank, generator=generator)
        if with_confidence_head:
            tensors["confidence_head.proj.weight"] = torch.randn(1, hidden + markov_rank, generator=generator) * 0.3
            tensors["confidence_head.proj.bias"] = torch.tensor([0.5])
        settings.update(markov_rank=markov_rank, sample_from_anchor=sample_from_anchor,
                        enable_confidence_head=with_confidence_head, confidence_head_with_markov=True)
    os.makedirs(folder, exist_ok=True)
    drafter_config = dict(config, model_type="qwen3", architectures=["DFlashDraftModel"], num_hidden_layers=num_layers,
                          head_dim=head_dim, draft_vocab_size=draft_vocab, dflash_config=settings)
    drafter_config.pop("transformers_version", None)
    with open(os.path.join(folder, "config.json"), "w") as handle:
        json.dump(drafter_config, handle)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    return folder
