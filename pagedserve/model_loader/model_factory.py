"""load_model: build the model class for a config and fill it from a weight stream."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from pagedserve.config.load import LoadConfig
from pagedserve.config.model import ModelConfig
from pagedserve.layers.linear import LinearBase
from pagedserve.layers.quantization.compressed_tensors_config import CompressedTensorsConfig
from pagedserve.layers.quantization.quantization_context import building_with_quantization
from pagedserve.layers.weight_layout import apply_weight_layout
from pagedserve.model_loader.gguf_quantized_load import interleave_kept_modules
from pagedserve.model_loader.load_strategies import load_checkpoint
from pagedserve.model_loader.safetensors_loader import safetensors_weight_files
from pagedserve.models.registry import resolve_model_class


def _hf_config(model_config: ModelConfig):  # type: ignore[no-untyped-def]
    if model_config.hf_config is not None:
        return model_config.hf_config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_config.model, local_files_only=True)


def load_model(model_config: ModelConfig, device: torch.device | str,
               weights: Iterable[tuple[str, torch.Tensor]] | None = None, *,
               load_config: LoadConfig | None = None, read_slices: bool = False,
               weight_layout: str = "plain") -> nn.Module:
    """Build the model for `model_config` on `device` in `model_config.dtype` and load its weights.

    `weights` is any stream of (HF parameter name, tensor) pairs (e.g. from a GGUF file), or a function of the
    built model returning one (ModelSource.weights with keep_quantized); when None,
    the *.safetensors files of the `model_config.model` folder are read with `load_config`'s strategy
    and threads (model_loader/load_strategies.py), as tensor-parallel slices when `read_slices`. Every
    parameter must be loaded, else ValueError names the missing ones. Then the linear layers take
    `weight_layout` ('plain' or 'prepacked', as resolved by layers/weight_layout.resolve_weight_layout).

    A checkpoint whose config.json has a compressed-tensors `quantization_config` (W8A8 int8) builds the layers
    it quantizes with their quantized method (layers/quantization/); an unsupported config is a ValueError before
    anything is built, and layout transforms leave quantized layers alone.
    """
    if weights is None:
        # Fail on a bad folder before building anything.
        safetensors_weight_files(model_config.model)
    hf_config = _hf_config(model_config)
    model_class = resolve_model_class(hf_config)
    device = torch.device(device)
    quantization = CompressedTensorsConfig.from_hf_config(
        hf_config, getattr(model_class, "packed_modules_mapping", None))
    if quantization is not None:
        quantization.check_lm_head()
    # Parameters are allocated uninitialised directly on the target device; the loader fills them.
    with torch.device(device), building_with_quantization(quantization):
        model = model_class(hf_config, model_config.dtype)
    if weights is None:
        loaded = load_checkpoint(model, model_config.model, model_config.dtype, load_config, read_slices,
                                 keep_file_dtype=quantization.is_scale_tensor if quantization is not None else None)
    else:
        if callable(weights):  # a stream that adapts the built model first (GGUF blocks kept quantized)
            weights = weights(model)
        loaded = model.load_weights(weights)
    missing = sorted(set(name for name, _ in model.named_parameters()) - loaded)
    if missing:
        shown = missing[:20] + ([f"... and {len(missing) - 20} more"] if len(missing) > 20 else [])
        raise ValueError(f"model {model_config.model!r}: the checkpoint has no weights for {len(missing)} "
                         f"parameter(s): {shown}")
    for module in model.modules():
        if isinstance(module, LinearBase) and module.linear_method.is_quantized:
            module.linear_method.process_weights_after_loading(module)
    interleave_kept_modules(model)  # GGUF blocks kept quantized: the layout their kernels read fastest
    apply_weight_layout(model, weight_layout)
    return model.eval()
