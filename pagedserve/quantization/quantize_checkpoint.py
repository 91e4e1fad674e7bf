"""`pagedserve quantize`: write a W8A8 int8 compressed-tensors checkpoint from an HF safetensors folder.

The output is what vLLM's compressed-tensors loader (and pagedserve's, layers/quantization/) reads: config.json with
a `quantization_config` (quant_method 'compressed-tensors', format 'int-quantized', one config group targeting
'Linear'), and per quantized linear `<module>.weight` int8 [out, in] and `<module>.weight_scale` float32 [out, 1]
(plus `<module>.input_scale` float32 [1] for static activation scales). The compressed-tensors package computes
the scales (`calculate_qparams`: symmetric round-to-nearest, one scale per output channel) and compresses the
weights (`IntQuantizationCompressor`); the scheme is its 'W8A8' preset (per-token dynamic activations), or the same
with static per-tensor activations whose scales come from the input ranges each linear saw while the float model
(HF transformers) ran over a calibration text (quantization/calibration.py).

Options that only change which tensors are stored, never the format:
- `smoothquant_alpha` (with a calibration text): SmoothQuant's per-channel smoothing (quantization/smoothquant.py)
  folded into the norms' and linears' float weights before they are rounded;
- `ignore`: further linear modules (names or 're:' regexes) kept in the model dtype and listed in `ignore`.

Quantized: the decoder layers' linear modules (HF nn.Linear) and, with dynamic activations, the MoE routed experts'
per-expert projections (`...experts.<E>.<projection>.weight`; transformers holds them as 3-D parameters, so they
are found by name). Kept as they are and listed in `ignore`: the LM head, MoE routers, MLA's kv_b_proj (read outside
its forward), the routed experts under static activations (the calibration run records nn.Linear inputs only), the
modules of `ignore`, and every non-linear tensor (embeddings, norms: smoothed ones are stored smoothed). Tokenizer and
other files are copied.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.layers.quantization.compressed_tensors_config import DEFAULT_PACKED_MODULES
from pagedserve.quantization.calibration import collect_input_channel_absmax, read_calibration_sequences
from pagedserve.quantization.smoothquant import CheckpointSmoothing, compute_smoothing, smoothing_mappings

SCHEMES = ("w8a8",)
# Linear modules kept in the model dtype (regexes on the HF module name, compressed-tensors 're:' entries).
_KEPT_LINEARS = (r".*lm_head$", r".*mlp\.gate$", r".*shared_expert_gate$", r".*kv_b_proj$")
# A routed expert's projection in the checkpoint (HF per-expert names).
_EXPERT_WEIGHT = re.compile(r"^(?P<module>.+\.experts\.\d+\.\w+)\.weight$")
_EXPERTS_IGNORE = r"re:.*\.experts\..*"
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
    # Smoothing mappings applied (0 without smoothquant_alpha).
    num_smoothed: int = 0
    # Linear modules kept in the model dtype because `ignore` named them.
    num_ignored: int = 0


def _scheme(is_static: bool) -> Any:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    scheme = preset_name_to_scheme("W8A8", ["Linear"])
    if is_static:
        scheme.input_activations = QuantizationArgs(num_bits=8, type="int", strategy="tensor", symmetric=True,
                                                    dynamic=False)
    scheme.format = "int-quantized"
    return QuantizationScheme.model_validate(scheme.model_dump())


def _module_names(folder: str) -> tuple[list[str], list[str]]:
    """(names of the HF model's nn.Linear modules, names of its RMSNorm modules), the model built on the meta
    device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    norms = [name for name, module in model.named_modules() if type(module).__name__.endswith("RMSNorm")]
    return linears, norms


def _is_kept(name: str) -> bool:
    return any(re.match(pattern, name) for pattern in _KEPT_LINEARS)


def _matches(name: str, entry: str) -> bool:
    """compressed-tensors' `ignore` semantics: an exact module name, or 're:<regex>' matched from the start."""
    return re.match(entry[3:], name) is not None if entry.startswith("re:") else name == entry


def _ignored_linears(linear_names: list[str], ignore: list[str]) -> list[str]:
    """The linears `ignore` names; ValueError for an entry that names none, or for a fused group (q/k/v, gate/up)
    that it splits (pagedserve and vLLM load those parts as one layer)."""
    ignored = {name for name in linear_names if any(_matches(name, entry) for entry in ignore)}
    for entry in ignore:
        if not any(_matches(name, entry) for name in linear_names):
            raise ValueError(f"ignore entry {entry!r} matches no linear module of the model (give module names such "
                             f"as 'model.layers.0.mlp.down_proj' or 're:' regexes such as 're:.*down_proj$')")
    for name in sorted(ignored):
        head, _, last = name.rpartition(".")
        for parts in DEFAULT_PACKED_MODULES.values():
            siblings = [f"{head}.{part}" for part in parts]
            if last in parts and any(sibling in linear_names and sibling not in ignored for sibling in siblings):
                raise ValueError(f"ignore keeps {name!r} but not all of {siblings}: they are loaded as one fused "
                                 f"layer, so ignore all of them or none")
    return sorted(ignored)


def _read_tensors(files: list[str], names: set[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    tensors = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as handle:
            for name in names.intersection(handle.keys()):
                tensors[name] = handle.get_tensor(name)
    return tensors


def quantize_checkpoint(model: str, out: str, scheme: str = "w8a8", calibration: str | None = None,
                        static: bool = False, smoothquant_alpha: float | None = None,
                        ignore: list[str] | None = None) -> QuantizeSummary:
    """Write the W8A8 checkpoint of the HF folder `model` into the new folder `out` (see the module docstring).
    `static` gives static per-tensor activation scales, `smoothquant_alpha` (in [0, 1]) SmoothQuant smoothing; both
    need `calibration`, a UTF-8 text file the float model runs over. `ignore`: more linear modules to keep (module
    names or 're:' regexes)."""
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
    if smoothquant_alpha is not None and calibration is None:
        raise ValueError("smoothquant_alpha needs calibration=FILE: the smoothing factors come from the activation "
                         "ranges of a calibration run")
    if smoothquant_alpha is not None and not 0.0 <= smoothquant_alpha <= 1.0:
        raise ValueError(f"smoothquant_alpha={smoothquant_alpha} must be in [0, 1]")
    if calibration is not None and not static and smoothquant_alpha is None:
        raise ValueError(f"calibration={calibration!r} is only used with static=True or smoothquant_alpha (the "
                         f"dynamic scheme computes activation scales per token at run time)")
    if calibration is not None and not os.path.isfile(calibration):
        raise ValueError(f"calibration={calibration!r} is not a file")
    files = safetensors_weight_files(model)
    if os.path.exists(out) and os.listdir(out):
        raise ValueError(f"out={out!r} exists and is not empty; give a new folder")
    with open(os.path.join(model, "config.json")) as handle:
        config_json = json.load(handle)
    if "quantization_config" in config_json:
        raise ValueError(f"model={model!r} is already quantized (its config.json has a quantization_config)")

    linear_names, norm_names = _module_names(model)
    ignored_names = _ignored_linears(linear_names, ignore or [])
    quantized_names = [name for name in linear_names if not _is_kept(name) and name not in ignored_names]
    kept_names = [name for name in linear_names if _is_kept(name) or name in ignored_names]
    quantization_scheme = _scheme(static)
    input_absmax: dict[str, torch.Tensor] = {}
    num_calibration_tokens = 0
    smoothing = CheckpointSmoothing([], [])
    if calibration is not None:
        sequences = read_calibration_sequences(model, calibration)
        num_calibration_tokens = sum(len(sequence) for sequence in sequences)
        mappings = [] if smoothquant_alpha is None else smoothing_mappings(linear_names, norm_names, quantized_names)
        if smoothquant_alpha is not None and not mappings:
            raise ValueError(f"model={model!r}: smoothquant_alpha found no norm/linear pair to smooth (it knows "
                             f"Llama-style decoder layers: input_layernorm -> q/k/v_proj, post_attention_layernorm "
                             f"-> gate/up_proj, up_proj -> down_proj)")
        observed = sorted(set(quantized_names if static else []) | {mapping.balance[0] for mapping in mappings})
        input_absmax = collect_input_channel_absmax(model, sequences, observed)
        if smoothquant_alpha is not None:
            balance_weights = _read_tensors(files, {f"{name}.weight" for mapping in mappings
                                                    for name in mapping.balance})
            smoothing = compute_smoothing(mappings, input_absmax, {name.removesuffix(".weight"): weight for name, weight
                                                                    in balance_weights.items()}, smoothquant_alpha)
        # A balance linear's input is divided by the factors, and so are its channel maxima (static scales).
        for mapping, factors in zip(smoothing.mappings, smoothing.scales):
            smoothed_absmax = input_absmax[mapping.balance[0]] / factors
            for name in mapping.balance:
                input_absmax[name] = smoothed_absmax

    quantized = set(quantized_names)
    tensors: dict[str, torch.Tensor] = {}
    num_quantized = num_experts_quantized = 0
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                stored = handle.get_tensor(name)
                tensor = smoothing.apply(name, stored)
                module_name = name.removesuffix(".weight")
                is_expert = not static and _EXPERT_WEIGHT.match(name) is not None
                if not (name.endswith(".weight") and (module_name in quantized or is_expert)):
                    tensors[name] = tensor.to(stored.dtype)  # a smoothed norm or kept linear keeps its dtype
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
                    absmax = input_absmax[module_name].max().reshape(1)
                    input_scale, _ = calculate_qparams(-absmax, absmax, quantization_scheme.input_activations)
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
                           num_calibration_tokens=num_calibration_tokens, num_smoothed=len(smoothing.mappings),
                           num_ignored=len(ignored_names))


__all__ = ["QuantizeSummary", "SCHEMES", "quantize_checkpoint"]
