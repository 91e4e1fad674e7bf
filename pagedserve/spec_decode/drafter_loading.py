"""load_draft_model: the drafter network of a speculative method that runs one, built and loaded beside the target.

  draft_model     a smaller model of its own (an HF folder), loaded like the target;
  eagle, eagle3   an EAGLE / EAGLE-3 checkpoint folder (config.json and *.safetensors, or pytorch_model*.bin as
                  the original EAGLE releases ship), sharing the target's embedding and, for EAGLE, its LM head;
  dflash, dspark  a DFlash / DSpark checkpoint folder, sharing the target's embedding and LM head when it has
                  none of its own;
  mtp             the multi-token-prediction layers stored in the target's own checkpoint after its decoder.
Every parameter must be loaded: a tensor the checkpoint lacks is a ValueError naming it.
"""
from __future__ import annotations

import glob
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedserve.config.speculative import DRAFTER_METHODS, HIDDEN_STATE_METHODS

if TYPE_CHECKING:
    from pagedserve.config.engine import EngineConfig
    from pagedserve.models.hidden_state_drafter import HiddenStateDrafter


def load_draft_model(config: "EngineConfig", device: torch.device, *, read_slices: bool, weight_layout: str,
                     target: nn.Module) -> nn.Module | None:
    """The drafter (None for methods without one and without speculation), in the target's dtype and weight
    layout, sliced for tensor parallelism like the target; a GGUF drafter keeps its blocks quantized as the target
    does (unless gguf_dequantize)."""
    speculative = config.speculative_config
    if speculative.method not in DRAFTER_METHODS:
        return None
    if speculative.method in HIDDEN_STATE_METHODS:
        return load_hidden_state_drafter(config, device, target, weight_layout)
    from pagedserve.config.model import ModelConfig
    from pagedserve.model_loader import load_model
    from pagedserve.model_loader.model_source import open_model_source

    model_config = config.model_config
    source = open_model_source(speculative.model)
    drafter_config = ModelConfig(model=source.path, dtype=model_config.dtype, max_model_len=model_config.max_model_len,
                                 hf_config=source.hf_config)
    weights = source.weights(model_config.dtype, keep_quantized=not config.load_config.gguf_dequantize)
    return load_model(drafter_config, device, weights=weights,
                      load_config=config.load_config, read_slices=read_slices, weight_layout=weight_layout)


def load_hidden_state_drafter(config: "EngineConfig", device: torch.device, target: nn.Module,
                              weight_layout: str) -> "HiddenStateDrafter":
    from pagedserve.layers.weight_layout import apply_weight_layout

    method = config.speculative_config.method
    dtype = config.model_config.dtype
    target_config = config.model_config.hf_config
    build: Callable[[frozenset[str]], "HiddenStateDrafter"]
    if method == "mtp":
        from pagedserve.models.multi_token_predictor import MultiTokenPredictor, num_mtp_layers

        folder = config.model_config.model
        first = int(target_config.num_hidden_layers)
        prefixes = tuple(f"model.layers.{index}." for index in range(first, first + num_mtp_layers(target_config)))
        tensors = read_checkpoint_tensors(folder, dtype, lambda name: name.startswith(prefixes))

        def build(names: frozenset[str]) -> "HiddenStateDrafter":
            return MultiTokenPredictor(target_config, dtype, target=target, checkpoint_names=names)
    else:
        folder = config.speculative_config.model
        assert folder is not None
        hf_config = drafter_hf_config(folder)
        tensors = read_checkpoint_tensors(folder, dtype, lambda name: True)
        if method == "eagle":
            from pagedserve.models.llama_eagle import EagleLlamaForCausalLM

            def build(names: frozenset[str]) -> "HiddenStateDrafter":
                return EagleLlamaForCausalLM(hf_config, dtype, checkpoint_names=names)
        else:
            drafter_class = _layer_reading_drafter_class(method)

            def build(names: frozenset[str]) -> "HiddenStateDrafter":
                return drafter_class(hf_config, dtype, checkpoint_names=names,
                                     target_num_layers=int(target_config.num_hidden_layers))
    try:
        with torch.device(device):
            drafter = build(frozenset(tensors))
        drafter.attach_target(target)
        loaded = drafter.load_weights(tensors.items())
    except ValueError as error:
        raise ValueError(f"speculative_config.method={method!r}, drafter checkpoint {folder!r}: {error}") from None
    missing = sorted(set(name for name, _ in drafter.named_parameters()) - loaded)
    if missing:
        raise ValueError(f"speculative_config.method={method!r}: the drafter checkpoint {folder!r} has no tensor for "
                         f"{len(missing)} parameter(s): {missing[:20]}")
    apply_weight_layout(drafter, weight_layout)
    return drafter.eval()


def _layer_reading_drafter_class(method: str) -> type:
    """The drafters that read target layers: EAGLE-3, DFlash, DSpark."""
    if method == "eagle3":
        from pagedserve.models.llama_eagle3 import Eagle3LlamaForCausalLM

        return Eagle3LlamaForCausalLM
    if method == "dflash":
        from pagedserve.models.qwen3_dflash import DFlashQwen3ForCausalLM

        return DFlashQwen3ForCausalLM
    from pagedserve.models.qwen3_dspark import DSparkQwen3ForCausalLM

    return DSparkQwen3ForCausalLM


def drafter_hf_config(folder: str) -> Any:
    """The drafter folder's config.json as a transformers config."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"speculative_config.model={folder!r}: no config.json there")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, local_files_only=True)


def checkpoint_files(folder: str) -> list[str]:
    """The folder's *.safetensors files, else its pytorch_model*.bin files; ValueError when it has neither."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        files = sorted(glob.glob(os.path.join(folder, "pytorch_model*.bin")))
    if not files:
        raise ValueError(f"speculative_config.model={folder!r}: no *.safetensors or pytorch_model*.bin files there")
    return files


def read_checkpoint_tensors(folder: str, dtype: torch.dtype, keep: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The tensors whose names `keep` accepts (only those are read), floating-point ones in `dtype`."""
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(folder):
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(path, framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    if keep(name):
                        tensors[name] = handle.get_tensor(name)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            tensors.update((name, tensor) for name, tensor in state.items() if keep(name))
    return {name: tensor.to(dtype) if tensor.is_floating_point() else tensor for name, tensor in tensors.items()}


__all__ = ["load_draft_model", "load_hidden_state_drafter", "read_checkpoint_tensors"]
