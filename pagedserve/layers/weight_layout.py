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
- 'plain_native' (CPU, float32): the plain weights, unchanged; decode batches (up to 16 rows on Intel CPUs,
  128 elsewhere) run on a native AVX-512 kernel that streams them faster than MKL's sgemm, larger ones on
  F.linear (MKL) or oneDNN's GEMM off Intel (layers/small_batch_linear.py). The LM head too.
- 'amx_packed' (CPU, bfloat16, the native kernels built): each weight is replaced by the native kernel's
  tile-blocked layout and every batch runs on that kernel (layers/amx_linear.py), its products on AMX tiles,
  VDPBF16PS dot products, or float32 FMA with the weights widened in registers (AVX-512 without BF16, AVX2):
  with AMX 1.4-1.5x oneDNN's packed GEMM at decode sizes, where a step streams the weights from DRAM; on AMD Zen 4
  (dot products) 1.36-1.42x at 1 row and 1.1-1.15x at 4-64; at the avx512 level 1.8-5x oneDNN's (docs/cpu-isa.md).
  The LM head too (a tied head gets a packed copy).
- 'auto': on the CPU in bfloat16, 'amx_packed' where the native kernels are built (every level's build has a
  unit for it), else
  'prepacked' (1.4-2.3x F.linear per GEMM at M = 1..64 for SmolLM2-135M's shapes: oneDNN with AMX/AVX-512
  otherwise reorders the weight on every F.linear call; benchmarks/weight_loading.py); 'plain_native' on the
  CPU in float32 where the native kernel is built (in float32 the packed GEMM was slower at M = 1, the decode
  case: on AMD Zen 4 18.8 against the native kernel's 26.1 GB/s over 30 layers' weights, and batch-1 decode
  reached 60% of the bandwidth roofline with it against 84%; batches above 128 rows there take oneDNN's GEMM on
  the plain weight, see layers/small_batch_linear.py); else 'plain': CUDA's cuBLAS reads [out, in] directly;
  batch_invariant=True needs the plain GEMMs its mode reroutes.

The packed GEMM itself is layers/prepacked_matmul.py.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from pagedserve.config.load import WEIGHT_LAYOUTS
from pagedserve.kernels import cpu_isa
from pagedserve.layers.amx_linear import AMX_PACKED_LAYOUT, AMX_PACKED_LINEAR_METHOD, amx_linear_available, amx_pack
from pagedserve.layers.embedding import ParallelLMHead
from pagedserve.layers.linear import UNQUANTIZED_LINEAR_METHOD, LinearBase, LinearMethodBase, packed_weight_of
from pagedserve.layers.prepacked_matmul import prepacked_matmul
from pagedserve.layers.small_batch_linear import (PLAIN_NATIVE_LAYOUT, SMALL_BATCH_LINEAR_METHOD,
                                                  small_batch_linear_available)

logger = logging.getLogger(__name__)

PLAIN_LAYOUT = "plain"
PREPACKED_LAYOUT = "prepacked"
# The layouts whose linears run on a native kernel: (the one dtype, whether the kernel is available here, what
# an explicit request needs, for the error).
_NATIVE_LAYOUTS = {
    PLAIN_NATIVE_LAYOUT: (torch.float32, small_batch_linear_available,
                          "float32 on the CPU with AVX-512 and the native kernels built"),
    AMX_PACKED_LAYOUT: (torch.bfloat16, amx_linear_available,
                        "bfloat16 on an x86-64 CPU with AVX2 or more, and the native kernels built"),
}
# PLAIN_NATIVE_LAYOUT ('plain_native') comes from layers/small_batch_linear.py, AMX_PACKED_LAYOUT ('amx_packed')
# from layers/amx_linear.py.
# Weight dtypes oneDNN packs on the CPU.
_PREPACKABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Dtypes for which 'auto' picks 'prepacked' on the CPU (measured faster; see the module docstring).
_AUTO_PREPACKED_DTYPES = (torch.bfloat16,)


def can_prepack_on_cpu(dtype: torch.dtype = torch.float32) -> bool:
    """oneDNN can pack and multiply `dtype` weights on this CPU: probed once per dtype with a tiny weight, never
    assumed (torch's CPU wheels ship oneDNN on x86 and aarch64, but its bf16 path needs AVX512-BW/VL/DQ or
    AVX-NE-CONVERT: an AVX2-only CPU refuses bf16 weights at the reorder)."""
    if dtype not in _PREPACKABLE_DTYPES or not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    if dtype not in _prepack_probes:
        _prepack_probes[dtype] = _probe_prepack(dtype)
    return _prepack_probes[dtype]


# dtype -> whether oneDNN packed and multiplied a tiny weight of it here.
_prepack_probes: dict[torch.dtype, bool] = {}


def _probe_prepack(dtype: torch.dtype) -> bool:
    try:
        weight = torch.ones(16, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        out = prepacked_matmul(torch.ones(2, 16, dtype=dtype), packed, None, 16)
    except RuntimeError as error:
        logger.info("oneDNN cannot pack %s weights on this CPU (%s): weight_layout='prepacked' is off for it", dtype,
                    str(error).splitlines()[0])
        return False
    return bool(torch.all(out == 16))


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

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return prepacked_matmul(x, packed_weight_of(layer), bias, layer.output_size_per_partition)


PREPACKED_LINEAR_METHOD = OneDnnPrepackedLinearMethod()


def resolve_weight_layout(weight_layout: str, device_type: str, dtype: torch.dtype,
                          batch_invariant: bool = False) -> str:
    """The layout to apply: 'plain', 'prepacked', 'plain_native' or 'amx_packed'. ValueError when an explicit
    layout cannot be honoured (naming what it needs)."""
    if weight_layout == PLAIN_LAYOUT:
        return PLAIN_LAYOUT
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout={weight_layout!r} must be one of {list(WEIGHT_LAYOUTS)}")
    if weight_layout != "auto" and batch_invariant:
        raise ValueError(f"weight_layout={weight_layout!r} with batch_invariant=True: the batch-invariant mode "
                         f"computes plain GEMMs in fixed row tiles; use weight_layout='plain' or 'auto'")
    can_pack = device_type == "cpu" and can_prepack_on_cpu(dtype)
    if weight_layout == PREPACKED_LAYOUT:
        if not can_pack:
            raise ValueError(f"weight_layout='prepacked' is not available for {dtype} on {device_type!r} "
                             f"(needs the CPU, oneDNN, and one of "
                             f"{[str(d).removeprefix('torch.') for d in _PREPACKABLE_DTYPES]} that oneDNN can run "
                             f"on this CPU; CPU ISA {cpu_isa.describe()}); layouts it can run: "
                             f"{runnable_layouts(device_type, dtype)}")
        return PREPACKED_LAYOUT
    # The native-kernel layouts run one dtype each, on the CPU, where their kernel is available (checked last:
    # that builds the native library at first use).
    def can_run_natively(layout: str) -> bool:
        native_dtype, is_available, _ = _NATIVE_LAYOUTS[layout]
        return device_type == "cpu" and dtype == native_dtype and is_available()

    if weight_layout in _NATIVE_LAYOUTS:
        if not can_run_natively(weight_layout):
            raise ValueError(f"weight_layout={weight_layout!r} is not available for {dtype} on {device_type!r} "
                             f"(needs {_NATIVE_LAYOUTS[weight_layout][2]}; CPU ISA {cpu_isa.describe()}); "
                             f"layouts it can run: {runnable_layouts(device_type, dtype)}")
        return weight_layout
    if batch_invariant:
        return PLAIN_LAYOUT
    if can_run_natively(AMX_PACKED_LAYOUT):
        return AMX_PACKED_LAYOUT
    if can_pack and dtype in _AUTO_PREPACKED_DTYPES:
        return PREPACKED_LAYOUT
    if can_run_natively(PLAIN_NATIVE_LAYOUT):
        return PLAIN_NATIVE_LAYOUT
    return PLAIN_LAYOUT


def runnable_layouts(device_type: str, dtype: torch.dtype) -> list[str]:
    """The explicit layouts this device and CPU can run for `dtype` ('plain' always)."""
    layouts = [PLAIN_LAYOUT]
    if device_type != "cpu":
        return layouts
    if can_prepack_on_cpu(dtype):
        layouts.append(PREPACKED_LAYOUT)
    for layout, (native_dtype, is_available, _) in _NATIVE_LAYOUTS.items():
        if dtype == native_dtype and is_available():
            layouts.append(layout)
    return layouts


def _linear_layers(model: nn.Module) -> list[LinearBase]:
    return [module for module in model.modules() if isinstance(module, LinearBase)]


def _lm_heads(model: nn.Module) -> list[ParallelLMHead]:
    return [module for module in model.modules() if isinstance(module, ParallelLMHead)]


def _prepack_lm_head(head: ParallelLMHead) -> bool:
    """Give `head` its packed weight (see the module docstring); False when it cannot be packed."""
    weight = head.weight
    if head.packed_weight is not None or weight.is_mkldnn or weight.device.type != "cpu" \
            or not can_prepack_on_cpu(weight.dtype):
        return False
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    if not head.is_tied:
        head.weight = nn.Parameter(packed, requires_grad=False)  # the plain tensor is freed: one copy
    head.packed_weight = packed
    head.linear_method = PREPACKED_LINEAR_METHOD
    return True


def _amx_pack_lm_head(head: ParallelLMHead) -> bool:
    """Give `head` the tile-packed layout (see the module docstring); False when it cannot be packed."""
    if head.linear_method is not UNQUANTIZED_LINEAR_METHOD or head.weight.dtype != torch.bfloat16 \
            or head.weight.device.type != "cpu":
        return False
    if head.is_tied:
        head.packed_weight = amx_pack(head.weight)  # the embedding keeps reading the plain table
    else:
        AMX_PACKED_LINEAR_METHOD.process_weights_after_loading(head)
    head.linear_method = AMX_PACKED_LINEAR_METHOD
    return True


def _restore_plain_weight(module: nn.Module) -> None:
    """Put the plain [out, in] weight back where a packed layout replaced it, and drop a packed copy."""
    if module.weight.is_mkldnn:
        plain = module.weight.detach().to_dense()
    elif module.linear_method is AMX_PACKED_LINEAR_METHOD and module.packed_weight is None:
        plain = AMX_PACKED_LINEAR_METHOD.plain_weight(module)
    else:
        plain = None
    if plain is not None:
        weight = nn.Parameter(plain, requires_grad=False)
        weight.weight_loader = module.weight_loader
        module.weight = weight
    module.packed_weight = None


def apply_weight_layout(model: nn.Module, layout: str) -> int:
    """Move every linear layer and LM head of a loaded `model` to `layout` ('plain', 'prepacked',
    'plain_native' or 'amx_packed', as resolved by resolve_weight_layout); returns the number of layers
    transformed."""
    if layout == PLAIN_LAYOUT:
        return 0
    if layout not in WEIGHT_LAYOUTS[2:]:  # config/load.py lists 'auto', 'plain', then the layouts that transform
        raise ValueError(f"weight layout {layout!r} is not a resolved layout {list(WEIGHT_LAYOUTS[1:])}")
    count = num_heads = 0
    with torch.no_grad():
        if layout == PREPACKED_LAYOUT:
            for layer in _linear_layers(model):
                if layer.weight_read_elsewhere or layer.linear_method.is_quantized \
                        or not can_prepack_on_cpu(layer.weight.dtype):
                    continue
                PREPACKED_LINEAR_METHOD.process_weights_after_loading(layer)
                layer.linear_method = PREPACKED_LINEAR_METHOD
                count += 1
            num_heads = sum(_prepack_lm_head(head) for head in _lm_heads(model))
        elif layout == AMX_PACKED_LAYOUT:
            if not amx_linear_available():
                raise ValueError("weight layout 'amx_packed' needs the native tile-packed kernel, which is not "
                                 "available here (resolve_weight_layout checks it)")
            for layer in _linear_layers(model):
                if layer.weight_read_elsewhere or layer.linear_method is not UNQUANTIZED_LINEAR_METHOD \
                        or layer.weight.dtype != torch.bfloat16 or layer.weight.is_mkldnn:
                    continue
                AMX_PACKED_LINEAR_METHOD.process_weights_after_loading(layer)
                layer.linear_method = AMX_PACKED_LINEAR_METHOD
                count += 1
            num_heads = sum(_amx_pack_lm_head(head) for head in _lm_heads(model))
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
        for module in _linear_layers(model) + _lm_heads(model):
            if module.linear_method is UNQUANTIZED_LINEAR_METHOD or module.linear_method.is_quantized:
                continue  # quantized layers keep their checkpoint layout
            _restore_plain_weight(module)
            module.linear_method = UNQUANTIZED_LINEAR_METHOD
            count += 1
    return count


def weight_layout_of(model: nn.Module) -> dict[str, int]:
    """How many linear layers hold each layout (for logs and tests; LM heads not counted)."""
    counts: dict[str, int] = {}
    for layer in _linear_layers(model):
        counts[layer.linear_method.layout] = counts.get(layer.linear_method.layout, 0) + 1
    return counts


__all__ = ["AMX_PACKED_LAYOUT", "PLAIN_LAYOUT", "PLAIN_NATIVE_LAYOUT", "PREPACKED_LAYOUT",
           "OneDnnPrepackedLinearMethod",
           "apply_weight_layout", "can_prepack_on_cpu", "resolve_weight_layout", "restore_plain_layout", "runnable_layouts",
           "weight_layout_of"]
