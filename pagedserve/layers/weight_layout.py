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
  kv_b_proj, the float32 MoE router) keep the plain layout. The LM head (layers/embedding.py's
  ParallelLMHead, not a linear of layers/linear.py) gets the same treatment through its `packed_weight`:
  an untied head's weight is replaced by the packed one; a tied head shares its tensor with the word
  embedding (F.embedding needs the plain rows), so it gets a packed *copy*: the vocabulary table's bytes
  once more (56 MB for SmolLM2-135M) for a logits GEMM measured 1.3x faster at batch 1 and 1.6x at batch
  64 (docs/params-06-weight-loading.md).
- 'plain_native' (CPU, float32): the plain weights, unchanged; batches of up to 16 rows (decode) run on a
  native AVX-512 kernel that streams them faster than MKL's sgemm, larger ones on F.linear
  (layers/small_batch_linear.py). The LM head too.
- 'auto': 'prepacked' where it was measured faster — the CPU in bfloat16 (1.4-2.3x per GEMM at
  M = 1..64 for SmolLM2-135M's shapes: oneDNN with AMX/AVX-512 otherwise reorders the weight on every
  F.linear call; benchmarks/weight_loading.py); 'plain_native' on the CPU in float32 where the native
  kernel is built (in float32 and float16 the packed GEMM was slower at M = 1, the decode case); else
  'plain': CUDA's cuBLAS reads [out, in] directly; batch_invariant=True needs the plain GEMMs its mode
  reroutes.

The packed GEMM itself is layers/prepacked_matmul.py.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from pagedserve.layers.embedding import ParallelLMHead
from pagedserve.layers.linear import UNQUANTIZED_LINEAR_METHOD, LinearBase, LinearMethodBase
from pagedserve.layers.prepacked_matmul import prepacked_matmul
from pagedserve.layers.small_batch_linear import (PLAIN_NATIVE_LAYOUT, SMALL_BATCH_LINEAR_METHOD,
                                                  small_batch_linear_available)

logger = logging.getLogger(__name__)

PLAIN_LAYOUT = "plain"
PREPACKED_LAYOUT = "prepacked"
# PLAIN_NATIVE_LAYOUT ('plain_native') comes from layers/small_batch_linear.py.
# Weight dtypes oneDNN packs on the CPU.
_PREPACKABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Dtypes for which 'auto' picks 'prepacked' on the CPU (measured faster; see the module docstring).
_AUTO_PREPACKED_DTYPES = (torch.bfloat16,)


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
        return prepacked_matmul(x, layer.weight, bias, layer.output_size_per_partition)


PREPACKED_LINEAR_METHOD = OneDnnPrepackedLinearMethod()


def resolve_weight_layout(weight_layout: str, device_type: str, dtype: torch.dtype,
                          batch_invariant: bool = False) -> str:
    """The layout to apply: 'plain', 'prepacked' or 'plain_native'. ValueError when an explicit layout cannot
    be honoured (naming what it needs)."""
    if weight_layout == PLAIN_LAYOUT:
        return PLAIN_LAYOUT
    if weight_layout not in ("auto", PREPACKED_LAYOUT, PLAIN_NATIVE_LAYOUT):
        raise ValueError(f"weight_layout={weight_layout!r} must be one of "
                         f"{['auto', PLAIN_LAYOUT, PREPACKED_LAYOUT, PLAIN_NATIVE_LAYOUT]}")
    if weight_layout != "auto" and batch_invariant:
        raise ValueError(f"weight_layout={weight_layout!r} with batch_invariant=True: the batch-invariant mode "
                         f"computes plain GEMMs in fixed row tiles; use weight_layout='plain' or 'auto'")
    can_pack = device_type == "cpu" and can_prepack_on_cpu() and dtype in _PREPACKABLE_DTYPES
    if weight_layout == PREPACKED_LAYOUT:
        if not can_pack:
            raise ValueError(f"weight_layout='prepacked' is not available for {dtype} on {device_type!r} "
                             f"(needs the CPU with oneDNN and one of "
                             f"{[str(d).removeprefix('torch.') for d in _PREPACKABLE_DTYPES]}); "
                             f"use 'plain' or 'auto'")
        return PREPACKED_LAYOUT
    # Checked last: it builds the native library at first use.
    can_run_native = device_type == "cpu" and dtype == torch.float32 and small_batch_linear_available()
    if weight_layout == PLAIN_NATIVE_LAYOUT:
        if not can_run_native:
            raise ValueError(f"weight_layout='plain_native' is not available for {dtype} on {device_type!r} "
                             f"(needs float32 on the CPU with AVX-512 and the native kernels built); "
                             f"use 'plain' or 'auto'")
        return PLAIN_NATIVE_LAYOUT
    if batch_invariant:
        return PLAIN_LAYOUT
    if can_pack and dtype in _AUTO_PREPACKED_DTYPES:
        return PREPACKED_LAYOUT
    if device_type == "cpu" and dtype == torch.float32 and small_batch_linear_available():
        return PLAIN_NATIVE_LAYOUT
    return PLAIN_LAYOUT


def _linear_layers(model: nn.Module) -> list[LinearBase]:
    return [module for module in model.modules() if isinstance(module, LinearBase)]


def _lm_heads(model: nn.Module) -> list[ParallelLMHead]:
    return [module for module in model.modules() if isinstance(module, ParallelLMHead)]


def _prepack_lm_head(head: ParallelLMHead) -> bool:
    """Give `head` its packed weight (see the module docstring); False when it cannot be packed."""
    weight = head.weight
    if head.packed_weight is not None or weight.is_mkldnn or weight.device.type != "cpu" \
            or weight.dtype not in _PREPACKABLE_DTYPES:
        return False
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    if not head.is_tied:
        head.weight = nn.Parameter(packed, requires_grad=False)  # the plain tensor is freed: one copy
    head.packed_weight = packed
    return True


def _restore_lm_head(head: ParallelLMHead) -> bool:
    if head.packed_weight is None:
        return False
    if head.weight.is_mkldnn:  # untied: the packed tensor replaced the plain one
        weight = nn.Parameter(head.weight.detach().to_dense(), requires_grad=False)
        weight.weight_loader = head.weight_loader
        head.weight = weight
    head.packed_weight = None
    return True


def apply_weight_layout(model: nn.Module, layout: str) -> int:
    """Move every linear layer and LM head of a loaded `model` to `layout` ('plain', 'prepacked' or
    'plain_native', as resolved by resolve_weight_layout); returns the number of layers transformed."""
    if layout == PLAIN_LAYOUT:
        return 0
    if layout not in (PREPACKED_LAYOUT, PLAIN_NATIVE_LAYOUT):
        raise ValueError(f"weight layout {layout!r} is not a resolved layout "
                         f"{[PLAIN_LAYOUT, PREPACKED_LAYOUT, PLAIN_NATIVE_LAYOUT]}")
    count = num_heads = 0
    with torch.no_grad():
        if layout == PREPACKED_LAYOUT:
            for layer in _linear_layers(model):
                if layer.weight_read_elsewhere or layer.weight.dtype not in _PREPACKABLE_DTYPES:
                    continue
                PREPACKED_LINEAR_METHOD.process_weights_after_loading(layer)
                layer.linear_method = PREPACKED_LINEAR_METHOD
                count += 1
            num_heads = sum(_prepack_lm_head(head) for head in _lm_heads(model))
        else:
            if not small_batch_linear_available():
                raise ValueError("weight layout 'plain_native' needs the native small-batch kernel, which is not "
                                 "available here (resolve_weight_layout checks it)")
            # The weights stay where they are: only the compute method changes (other readers are unaffected).
            for module in _linear_layers(model) + _lm_heads(model):
                if module.linear_method is not UNQUANTIZED_LINEAR_METHOD or module.weight.dtype != torch.float32 \
                        or module.weight.is_mkldnn:
                    continue
                SMALL_BATCH_LINEAR_METHOD.process_weights_after_loading(module)
                module.linear_method = SMALL_BATCH_LINEAR_METHOD
                if isinstance(module, ParallelLMHead):
                    num_heads += 1
                else:
                    count += 1
    logger.info("weight layout %r: %d linear layers and %d LM head(s) transformed", layout, count, num_heads)
    return count + num_heads


def restore_plain_layout(model: nn.Module) -> int:
    """Unpack every prepacked linear (and LM head) back to its plain [out, in] weight (bit for bit) so that
    weight loaders can write into it again, and put every layer back on F.linear; returns the number of
    layers restored."""
    count = 0
    with torch.no_grad():
        for layer in _linear_layers(model):
            if layer.linear_method is UNQUANTIZED_LINEAR_METHOD:
                continue
            if layer.weight.is_mkldnn:
                weight = nn.Parameter(layer.weight.detach().to_dense(), requires_grad=False)
                weight.weight_loader = layer.weight_loader
                layer.weight = weight
            layer.linear_method = UNQUANTIZED_LINEAR_METHOD
            count += 1
        for head in _lm_heads(model):
            restored = _restore_lm_head(head) or head.linear_method is not UNQUANTIZED_LINEAR_METHOD
            head.linear_method = UNQUANTIZED_LINEAR_METHOD
            count += restored
    return count


def weight_layout_of(model: nn.Module) -> dict[str, int]:
    """How many linear layers hold each layout (for logs and tests; LM heads not counted)."""
    counts: dict[str, int] = {}
    for layer in _linear_layers(model):
        counts[layer.linear_method.layout] = counts.get(layer.linear_method.layout, 0) + 1
    return counts


__all__ = ["PLAIN_LAYOUT", "PLAIN_NATIVE_LAYOUT", "PREPACKED_LAYOUT", "OneDnnPrepackedLinearMethod",
           "apply_weight_layout", "can_prepack_on_cpu", "resolve_weight_layout", "restore_plain_layout", "weight_layout_of"]
