"""SmoothQuant for `pagedserve quantize --smoothquant-alpha A`: move activation outliers into the weights before
round-to-nearest W8A8 (Xiao et al. 2023; the scale formula of llm-compressor's SmoothQuantModifier).

A mapping pairs a *smooth* module with the *balance* linears that read its output and nothing else. Per input
channel c of the balance linears,

    s_c = max|x_c| ** alpha / max_over_balance_rows |W[:, c]| ** (1 - alpha)      (clamped to >= 1e-5)

from the calibration run's per-channel activation maxima (quantization/calibration.py). The smooth module's output
channel c is divided by s_c (an RMSNorm's weight element, or a linear's output row) and every balance linear's
input column c multiplied by it: the float model computes the same function, but the balance linears' inputs lose
their outlier channels, so per-token int8 activations lose less, at the cost of a slightly wider weight range.
Only stored tensors change: the checkpoint stays a plain compressed-tensors W8A8 one that any loader reads.

Mappings (per decoder layer, where all the named modules exist as linear layers or norms):
- `input_layernorm` -> `self_attn.q_proj`, `k_proj`, `v_proj`      (llm-compressor's default for Llama-style models)
- `post_attention_layernorm` -> `mlp.gate_proj`, `mlp.up_proj`     (its default too; dense MLPs only: in MoE layers
  the norm also feeds the router)
- `mlp.up_proj` -> `mlp.down_proj`: down_proj reads silu(gate) * up, which is linear in each up channel
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

# Smallest smoothing factor (the SmoothQuant reference's clamp): a channel never seen active is not blown up.
_MIN_SCALE = 1e-5
_DECODER_LAYER = re.compile(r"^(?P<layer>.*\.layers\.\d+)\.")
# (smooth module, balance linears) relative to a decoder layer.
_LAYER_MAPPINGS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
)


@dataclass(frozen=True)
class SmoothingMapping:
    """One smooth module (an RMSNorm, or a linear whose output rows are scaled) and the linears reading its output."""

    smooth: str
    balance: tuple[str, ...]


def smoothing_mappings(linear_names: list[str], norm_names: list[str],
                       quantized_names: list[str] | None = None) -> list[SmoothingMapping]:
    """The mappings of the module docstring that the model has: `linear_names` are its nn.Linear modules,
    `norm_names` its RMSNorm modules (HF names). A mapping is kept only when its smooth module and every balance
    linear exist (the balance linears are then the only readers of the smooth module's output: the fixed per-layer
    names guarantee it for the dense families, Llama, Mistral, Qwen2/3, and the dense layers of MoE models) and,
    when `quantized_names` is given, at least one balance linear is quantized (smoothing buys a float linear
    nothing)."""
    linears, norms = set(linear_names), set(norm_names)
    quantized = linears if quantized_names is None else set(quantized_names)
    layers = sorted({match["layer"] for name in linear_names if (match := _DECODER_LAYER.match(name))},
                    key=lambda layer: int(layer.rsplit(".", 1)[1]))
    mappings = []
    for layer in layers:
        for smooth, balance in _LAYER_MAPPINGS:
            smooth_name = f"{layer}.{smooth}"
            balance_names = tuple(f"{layer}.{name}" for name in balance)
            if (smooth_name in norms or smooth_name in linears) and all(name in linears for name in balance_names) \
                    and any(name in quantized for name in balance_names):
                mappings.append(SmoothingMapping(smooth_name, balance_names))
    return mappings


def smoothing_scales(activation_absmax: torch.Tensor, balance_weights: list[torch.Tensor],
                     alpha: float) -> torch.Tensor:
    """float32 [in_features] smoothing factors s (see the module docstring) from the balance linears' shared input's
    per-channel maxima and their weights [out_i, in_features]."""
    weight_absmax = torch.stack([weight.float().abs().amax(dim=0) for weight in balance_weights]).amax(dim=0)
    scales = activation_absmax.float().pow(alpha) / weight_absmax.pow(1 - alpha)
    # A channel whose weights are all zero has no range to take the outlier: leave its activation where it is.
    scales = torch.where(weight_absmax > 0, scales, torch.ones_like(scales))
    return scales.clamp(min=_MIN_SCALE)


class CheckpointSmoothing:
    """The smoothing factors of every mapping, applied to checkpoint tensors by name as they are read."""

    def __init__(self, mappings: list[SmoothingMapping], scales: list[torch.Tensor]) -> None:
        self.mappings, self.scales = mappings, scales
        # checkpoint tensor name -> factors its output rows (1-D: its elements) are divided by
        self.divided_rows: dict[str, torch.Tensor] = {}
        # checkpoint tensor name -> factors its input columns are multiplied by
        self.multiplied_columns: dict[str, torch.Tensor] = {}
        for mapping, factors in zip(mappings, scales):
            self.divided_rows[f"{mapping.smooth}.weight"] = factors
            self.divided_rows[f"{mapping.smooth}.bias"] = factors
            for name in mapping.balance:
                self.multiplied_columns[f"{name}.weight"] = factors

    def apply(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The checkpoint tensor `name` after smoothing (in float32 when it changed, as it was otherwise)."""
        divided, multiplied = self.divided_rows.get(name), self.multiplied_columns.get(name)
        if divided is None and multiplied is None:
            return tensor
        values = tensor.float()
        if divided is not None:
            values = values / (divided if values.dim() == 1 else divided[:, None])
        if multiplied is not None:
            values = values * multiplied[None, :]
        return values


def compute_smoothing(mappings: list[SmoothingMapping], activation_absmax: dict[str, torch.Tensor],
                      weights: dict[str, torch.Tensor], alpha: float) -> CheckpointSmoothing:
    """The smoothing of `mappings` at strength `alpha` in [0, 1]; `activation_absmax[balance]` is the per-channel
    input maximum of each mapping's first balance linear (they share the input), `weights[name]` every balance
    linear's float weight."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smoothquant_alpha={alpha} must be in [0, 1]")
    scales = [smoothing_scales(activation_absmax[mapping.balance[0]], [weights[name] for name in mapping.balance],
                               alpha) for mapping in mappings]
    return CheckpointSmoothing(mappings, scales)


__all__ = ["CheckpointSmoothing", "SmoothingMapping", "compute_smoothing", "smoothing_mappings", "smoothing_scales"]
