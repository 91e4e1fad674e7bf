"""`pagedserve quantize`: write a W8A8 int8 compressed-tensors checkpoint from an HF safetensors folder.

The output is what vLLM's compressed-tensors loader (and pagedserve's, layers/quantization/) reads: config.json with
a `quantization_config` (quant_method 'compressed-tensors', format 'int-quantized', one config group targeting
'Linear'), and per quantized linear `<module>.weight` int8 [out, in] and `<module>.weight_scale` float32 [out, 1]
(plus `<module>.input_scale` float32 [1] for static activation scales). The compressed-tensors package computes
the scales (`calculate_qparams`: symmetric round-to-nearest, one scale per output channel) and compresses the
weights (`IntQuantizationCompressor`); the scheme is its 'W8A8' preset (per-token dynamic activations), or the same
with static per-tensor activations whose scales come from the input ranges each linear saw while the float model
(HF transformers) ran over a calibration text.

Quantized: the decoder layers' linear modules (HF nn.Linear) and, with dynamic activations, the MoE routed experts'
per-expert projections (`...experts.<E>.<projection>.weight`; transformers holds them as 3-D parameters, so they
are found by name). Kept as they are and listed in `ignore`: the LM head, MoE routers, MLA's kv_b_proj (read outside
its forward), the routed experts under static activations (the calibration run records nn.Linear inputs only), and
every non-linear tensor (embeddings, norms). Tokenizer and other files are copied.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import torch

SCHEMES = ("w8a8",)
# Linear modules kept in the model dtype (regexes on the HF module name, compressed-tensors 're:' entries).
_KEPT_LINEARS = (r".*lm_head$", r".*mlp\.gate$", r".*shared_expert_gate$", r".*kv_b_proj$")
# A routed expert's projection in the checkpoint (HF per-expert names).
_EXPERT_WEIGHT = re.compile(r"^(?P<module>.+\.experts\.\d+\.\w+)\.weight$")
_EXPERTS_IGNORE = r"re:.*\.experts\..*"
_CALIBRATION_SEQUENCE_TOKENS = 512
_OUTPUT_FILE = "model.safetensors"
_SKIPPED_FILES = ("model.safetensors.index.json", "config.json")


@dataclass
class QuantizeSummary:
    """What `quantize_checkpoint` wrote."""

    out: str
    num_quantized: int
    num_kept: int
    is_static: bool
    num_calibration_tokens: int


def _scheme(is_static: bool) -> Any:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    scheme = preset_name_to_scheme("W8A8", ["Linear"])
    if is_static:
        scheme.input_activations = QuantizationArgs(num_bits=8, type="int", strategy="tensor", symmetric=True,
                                                    dynamic=False)
    scheme.format = "int-quantized"
    return QuantizationScheme.model_validate(scheme.model_dump())


def _linear_module_names(folder: str) -> tuple[list[str], Any]:
    """(names of the HF model's nn.Linear modules, the HF config), the model built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)], config


def _is_kept(name: str) -> bool:
    return any(re.match(pattern, name) for pattern in _KEPT_LINEARS)


def _read_calibration_tokens(folder: str, calibration: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    with open(calibration, encoding="utf-8") as handle:
        text = handle.read()
    if not text.strip():
        raise ValueError(f"calibration={calibration!r}: the file is empty")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    token_ids = tokenizer(text)["input_ids"]
    return [token_ids[start:start + _CALIBRATION_SEQUENCE_TOKENS]
            for start in range(0, len(token_ids), _CALIBRATION_SEQUENCE_TOKENS)]


@torch.no_grad()
def calibrate_input_ranges(folder: str, sequences: list[list[int]], names: list[str]) -> dict[str, tuple[float, float]]:
    """(min, max) of the input each linear in `names` saw while the float32 HF model ran over `sequences`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    ranges: dict[str, tuple[float, float]] = {}
    handles = []
    wanted = set(names)
    for name, module in model.named_modules():
        if name not in wanted:
            continue

        def record(module: torch.nn.Module, args: tuple, name: str = name) -> None:
            low, high = float(args[0].min()), float(args[0].max())
            old_low, old_high = ranges.get(name, (low, high))
            ranges[name] = (min(low, old_low), max(high, old_high))

        handles.append(module.register_forward_pre_hook(record))
    try:
        for sequence in sequences:
            model(torch.tensor([sequence]))
    finally:
        for handle in handles:
            handle.remove()
    missing = sorted(wanted - set(ranges))
    if missing:
        raise ValueError(f"calibration: the model never ran the linear(s) {missing[:5]}; no static scale for them")
    return ranges


def quantize_checkpoint(model: str, out: str, scheme: str = "w8a8", calibration: str | None = None,
                        static: bool = False) -> QuantizeSummary:
    """Write the W8A8 checkpoint of the HF folder `model` into the new folder `out` (see the module docstring).
    `static` (needs `calibration`, a UTF-8 text file) gives static per-tensor activation scales."""
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pagedserve.model_loader.safetensors_loader import safetensors_weight_files

    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} is not supported; supported: {list(SCHEMES)}")
    if static and calibration is None:
        raise ValueError("static=True needs calibration=FILE: static activation scales come from a calibration run")
    if calibration is not None and not static:
        raise ValueError(f"calibration={calibration!r} is only used with static=True (the dynamic scheme computes "
                         f"activation scales per token at run time)")
    if calibration is not None and not os.path.isfile(calibration):
        raise ValueError(f"calibration={calibration!r} is not a file")
    files = safetensors_weight_files(model)
    if os.path.exists(out) and os.listdir(out):
        raise ValueError(f"out={out!r} exists and is not empty; give a new folder")
    with open(os.path.join(model, "config.json")) as handle:
        config_json = json.load(handle)
    if "quantization_config" in config_json:
        raise ValueError(f"model={model!r} is already quantized (its config.json has a quantization_config)")

    linear_names, _ = _linear_module_names(model)
    quantized_names = [name for name in linear_names if not _is_kept(name)]
    kept_names = [name for name in linear_names if _is_kept(name)]
    quantization_scheme = _scheme(static)
    input_ranges: dict[str, tuple[float, float]] = {}
    num_calibration_tokens = 0
    if static:
        sequences = _read_calibration_tokens(model, calibration)  # type: ignore[arg-type]
        num_calibration_tokens = sum(len(sequence) for sequence in sequences)
        input_ranges = calibrate_input_ranges(model, sequences, quantized_names)

    quantized = set(quantized_names)
    tensors: dict[str, torch.Tensor] = {}
    num_quantized = num_experts_quantized = 0
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                module_name = name.removesuffix(".weight")
                is_expert = not static and _EXPERT_WEIGHT.match(name) is not None
                if not (name.endswith(".weight") and (module_name in quantized or is_expert)):
                    tensors[name] = tensor
                    continue
                if tensor.dim() != 2 or not tensor.is_floating_point():
                    raise ValueError(f"{name}: expected a 2-D floating-point linear weight, got shape "
                                     f"{tuple(tensor.shape)} dtype {tensor.dtype}")
                weight = tensor.float()
                scale, zero_point = calculate_qparams(weight.amin(dim=1, keepdim=True),
                                                      weight.amax(dim=1, keepdim=True), quantization_scheme.weights)
                compressed = IntQuantizationCompressor.compress(
                    {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}, quantization_scheme)
                tensors[name] = compressed["weight"].contiguous()
                tensors[f"{module_name}.weight_scale"] = compressed["weight_scale"].float().reshape(-1, 1).contiguous()
                if static:
                    low, high = input_ranges[module_name]
                    input_scale, _ = calculate_qparams(torch.tensor([low]), torch.tensor([high]),
                                                       quantization_scheme.input_activations)
                    tensors[f"{module_name}.input_scale"] = input_scale.float().reshape(1)
                num_quantized += 1
                num_experts_quantized += is_expert
    if num_quantized == 0:
        raise ValueError(f"model={model!r}: no linear layer weight to quantize was found")

    os.makedirs(out, exist_ok=True)
    for entry in os.listdir(model):
        source = os.path.join(model, entry)
        if os.path.isfile(source) and not entry.endswith(".safetensors") and entry not in _SKIPPED_FILES:
            shutil.copy2(source, os.path.join(out, entry))
    save_file(tensors, os.path.join(out, _OUTPUT_FILE), metadata={"format": "pt"})
    quantization_config = QuantizationConfig(
        config_groups={"group_0": quantization_scheme}, format="int-quantized", quantization_status="compressed",
        # Routers and routed experts are not nn.Linear modules in transformers 5 (a router module, fused 3-D expert
        # parameters): the kept kinds are listed by pattern as well as by name.
        ignore=kept_names + [f"re:{pattern}" for pattern in _KEPT_LINEARS[1:]]
        + ([] if num_experts_quantized else [_EXPERTS_IGNORE]))
    config_json["quantization_config"] = quantization_config.model_dump(mode="json", exclude_none=True)
    with open(os.path.join(out, "config.json"), "w") as handle:
        json.dump(config_json, handle, indent=2)
    return QuantizeSummary(out=out, num_quantized=num_quantized, num_kept=len(tensors) - 2 * num_quantized
                           - (num_quantized if static else 0), is_static=static,
                           num_calibration_tokens=num_calibration_tokens)


__all__ = ["QuantizeSummary", "SCHEMES", "calibrate_input_ranges", "quantize_checkpoint"]
