"""weight_layout: after loading, linear weights take the layout the platform's GEMM prefers.

The portable analogue of Ascend's weight NZ mode (vllm-ascend `weight_nz_mode`, algorithm note M8): a
pure layout transform at load time, behind the linear-method seam of layers/linear.py.

- 'plain': every linear keeps its [out, in] weight and computes with F.linear.
- 'prepacked' (CPU): each linear's weight is reordered once into oneDNN's blocked layout
  (`mkldnn._reorder_linear_weight`) and computed with `mkldnn._linear_pointwise`, which then skips
  the per-call weight reorder F.linear pays. The packed tensor *replaces* the plain one (one copy of the
  weights in memory); it stays registered as `weight` with the logical shape and dtype, and
  `restore_plain_layout` unpacks it bit for bit (`to_dense`) when plain weights are needed again
  (weight sync, reloading). Layers whose weight other code reads (`weight_read_elsewhere`: MLA's
  kv_b_proj, the float32 MoE router) keep the plain layout. The LM head and the word embedding are not
  linear layers of layers/linear.py and stay plain: tied models share that one tensor with
  F.embedding, and a packed copy would double its memory.
- 'auto': 'prepacked' where it was measured faster — the CPU in bfloat16 (1.4-2.3x per GEMM at
  M = 1..64 for SmolLM2-135M's shapes: oneDNN with AMX/AVX-512 otherwise reorders the weight on every
  F.linear call; benchmarks/weight_loading.py) — else 'plain': in float32 (F.linear runs MKL's sgemm)
  and float16 the packed GEMM was slower at M = 1, the decode case, and faster only at some larger M;
  CUDA's cuBLAS reads [out, in] directly; batch_invariant=True needs the plain GEMMs its mode reroutes.

Under torch.compile the packed GEMM is the opaque custom op `pagedserve::prepacked_linear` (inductor's
own lowering of `mkldnn._linear_pointwise` requires frozen constant weights); eager calls the ATen op
directly, which saves the custom-op dispatch on every call.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from pagedserve.layers.linear import UNQUANTIZED_LINEAR_METHOD, LinearBase, LinearMethodBase

logger = logging.getLogger(__name__)

PLAIN_LAYOUT = "plain"
PREPACKED_LAYOUT = "prepacked"
# Weight dtypes oneDNN packs on the CPU.
_PREPACKABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Dtypes for which 'auto' picks 'prepacked' on the CPU (measured faster; see the module docstring).
_AUTO_PREPACKED_DTYPES = (torch.bfloat16,)


@torch.library.custom_op("pagedserve::prepacked_linear", mutates_args=())
def prepacked_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                     output_size: int) -> torch.Tensor:
    """x @ W^T + b with W in oneDNN's packed layout (the traceable form of the eager call)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@prepacked_linear.register_fake
def _prepacked_linear_fake(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                           output_size: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], output_size))


def can_prepack_on_cpu() -> bool:
    """oneDNN is built in and usable (torch's CPU wheels on x86 and aarch64 ship it)."""
    return bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)


class OneDnnPrepackedLinearMethod(LinearMethodBase):
    """CPU: the weight lives in oneDNN's blocked layout for the layer's GEMM."""

    layout = PREPACKED_LAYOUT

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        plain = layer.weight.detach()
        if plain.is_mkldnn:
            return  # already packed
        packed = torch.ops.mkldnn._reorder_linear_weight(plain.contiguous(), None)
        # Replacing the Parameter frees the plain tensor: one copy of the weights stays in memory.
        layer.weight = nn.Parameter(packed, requires_grad=False)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.pagedserve.prepacked_linear(x, layer.weight, bias, layer.output_size_per_partition)
        return torch.ops.mkldnn._linear_pointwise(x, layer.weight, bias, "none", [], "")


PREPACKED_LINEAR_METHOD = OneDnnPrepackedLinearMethod()


def resolve_weight_layout(weight_layout: str, device_type: str, dtype: torch.dtype,
                          batch_invariant: bool = False) -> str:
    """The layout to apply: 'plain' or 'prepacked'. ValueError when 'prepacked' cannot be honoured."""
    if weight_layout == PLAIN_LAYOUT:
        return PLAIN_LAYOUT
    available = device_type == "cpu" and can_prepack_on_cpu() and dtype in _PREPACKABLE_DTYPES
    if weight_layout == PREPACKED_LAYOUT:
        if batch_invariant:
            raise ValueError("weight_layout='prepacked' with batch_invariant=True: the batch-invariant mode "
                             "computes plain GEMMs in fixed row tiles; use weight_layout='plain' or 'auto'")
        if not available:
            raise ValueError(f"weight_layout='prepacked' is not available for {dtype} on {device_type!r} "
                             f"(needs the CPU with oneDNN and one of "
                             f"{[str(d).removeprefix('torch.') for d in _PREPACKABLE_DTYPES]}); "
                             f"use 'plain' or 'auto'")
        return PREPACKED_LAYOUT
    if weight_layout != "auto":
        raise ValueError(f"weight_layout={weight_layout!r} must be one of ['auto', 'plain', 'prepacked']")
    if available and not batch_invariant and dtype in _AUTO_PREPACKED_DTYPES:
        return PREPACKED_LAYOUT
    return PLAIN_LAYOUT


def _linear_layers(model: nn.Module) -> list[LinearBase]:
    return [module for module in model.modules() if isinstance(module, LinearBase)]


def apply_weight_layout(model: nn.Module, layout: str) -> int:
    """Move every linear layer of a loaded `model` to `layout` ('plain' or 'prepacked', as resolved by
    resolve_weight_layout); returns the number of layers transformed."""
    if layout == PLAIN_LAYOUT:
        return 0
    if layout != PREPACKED_LAYOUT:
        raise ValueError(f"weight layout {layout!r} is not a resolved layout ('plain' or 'prepacked')")
    count = 0
    with torch.no_grad():
        for layer in _linear_layers(model):
            if layer.weight_read_elsewhere or layer.weight.dtype not in _PREPACKABLE_DTYPES:
                continue
            PREPACKED_LINEAR_METHOD.process_weights_after_loading(layer)
            layer.linear_method = PREPACKED_LINEAR_METHOD
            count += 1
    logger.info("weight layout %r: %d linear layers transformed", layout, count)
    return count


def restore_plain_layout(model: nn.Module) -> int:
    """Unpack every prepacked linear back to its plain [out, in] weight (bit for bit) so that weight
    loaders can write into it again; returns the number of layers restored."""
    count = 0
    with torch.no_grad():
        for layer in _linear_layers(model):
            if layer.linear_method is UNQUANTIZED_LINEAR_METHOD:
                continue
            weight = nn.Parameter(layer.weight.detach().to_dense(), requires_grad=False)
            weight.weight_loader = layer.weight_loader
            layer.weight = weight
            layer.linear_method = UNQUANTIZED_LINEAR_METHOD
            count += 1
    return count


def weight_layout_of(model: nn.Module) -> dict[str, int]:
    """How many linear layers hold each layout (for logs and tests)."""
    counts: dict[str, int] = {}
    for layer in _linear_layers(model):
        counts[layer.linear_method.layout] = counts.get(layer.linear_method.layout, 0) + 1
    return counts


__all__ = ["PLAIN_LAYOUT", "PREPACKED_LAYOUT", "OneDnnPrepackedLinearMethod", "apply_weight_layout",
           "can_prepack_on_cpu", "resolve_weight_layout", "restore_plain_layout", "weight_layout_of"]
