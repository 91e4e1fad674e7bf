"""W8A8 int8 linear method: int8 weights with per-channel scales, int8 activations (dynamic per token or static
per tensor), int32 accumulation (issue #30 part 1; vllm-ascend's w8a8_dynamic / w8a8_static, algorithm note M6).

Parameters (compressed-tensors' 'int-quantized' names, as vLLM loads them):
- `weight` int8 [output_size_per_partition, input_size_per_partition] (HF's [out, in]), sharded like a plain weight;
- `weight_scale` float32 [output_size_per_partition, 1]: rows shard with the weight's rows on column-parallel
  layers (and per logical matrix on fused q/k/v and gate/up) and stay whole on row-parallel ones. A per-tensor
  weight scale ([1] per logical matrix in the checkpoint) is expanded to its matrix's rows at load;
- `input_scale` float32 [1] (static scheme only): whole on every rank; a fused layer's parts share their input, so
  it keeps the largest of their scales (as vLLM).

y = (x_q @ w_q^T) * x_scale * w_scale + b. Where the native library runs, one op does it all (quantization,
int8 products, epilogue: int8_matmul.native_w8a8_linear); elsewhere the PyTorch forms of int8_matmul.py do.
`w8a8_reference_linear` is the plain float32 dequantize-then-F.linear form the tests compare against.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.linear import (LinearBase, LinearMethodBase, MergedColumnParallelLinear, QKVParallelLinear,
                                      RowParallelLinear)
from pagedserve.layers.quantization.int8_matmul import (half_precision_kernel_fits, int8_matmul_exact,
                                                         int8_matmul_scaled_half, native_w8a8_linear,
                                                         quantize_per_tensor)
from pagedserve.layers.quantization.int8_quant_op import is_tracing, quantize_per_token_traceable

W8A8_INT8_LAYOUT = "w8a8_int8"


class W8A8Int8LinearMethod(LinearMethodBase):
    """One instance per (activation scheme, weight-scale granularity); layers hold their own tensors."""

    layout = W8A8_INT8_LAYOUT
    is_quantized = True

    def __init__(self, *, is_static_input: bool, is_per_tensor_weight: bool = False) -> None:
        self.is_static_input = is_static_input
        self.is_per_tensor_weight = is_per_tensor_weight

    def __repr__(self) -> str:
        activations = "static per-tensor" if self.is_static_input else "dynamic per-token"
        weights = "per-tensor" if self.is_per_tensor_weight else "per-channel"
        return f"W8A8Int8LinearMethod({weights} int8 weights, {activations} int8 activations)"

    # ---- parameters ---------------------------------------------------------------------------------------
    def create_weights(self, layer: LinearBase, params_dtype: torch.dtype) -> None:
        """Register `weight`, `weight_scale` (and `input_scale`) on `layer`, each with its weight_loader;
        `params_dtype` is the model's dtype (activations, bias and output)."""
        layer.params_dtype = params_dtype
        weight = nn.Parameter(torch.empty(layer.output_size_per_partition, layer.input_size_per_partition,
                                          dtype=torch.int8), requires_grad=False)
        weight.weight_loader = lambda param, loaded, shard_id=None: self._load_weight(layer, param, loaded, shard_id)
        layer.weight = weight
        weight_scale = nn.Parameter(torch.empty(layer.output_size_per_partition, 1, dtype=torch.float32),
                                    requires_grad=False)
        weight_scale.weight_loader = (
            lambda param, loaded, shard_id=None: self._load_weight_scale(layer, param, loaded, shard_id))
        layer.weight_scale = weight_scale
        if self.is_static_input:
            # Zero until loaded: fused parts merge by maximum (see the module docstring).
            input_scale = nn.Parameter(torch.zeros(1, dtype=torch.float32), requires_grad=False)
            input_scale.weight_loader = (
                lambda param, loaded, shard_id=None: self._load_input_scale(layer, param, loaded, shard_id))
            layer.input_scale = input_scale

    @staticmethod
    def _name(layer: LinearBase, field: str, shard_id: object) -> str:
        where = f"{layer.prefix or type(layer).__name__}.{field}"
        return where if shard_id is None else f"{where} (part {shard_id!r} of the fused layer)"

    def _load_weight(self, layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, shard_id: object) -> None:
        if loaded.dtype != torch.int8:
            raise ValueError(f"{self._name(layer, 'weight', shard_id)}: checkpoint tensor has dtype {loaded.dtype}, "
                             f"but quantization_config quantizes this layer to int8 (format 'int-quantized' stores "
                             f"int8 weights)")
        layer.weight_loader(param, loaded, shard_id)

    @staticmethod
    def _logical_rows(layer: LinearBase, shard_id: object) -> int:
        """Rows of the checkpoint matrix a (layer, shard_id) load carries."""
        if shard_id is None:
            return layer.output_size
        if isinstance(layer, QKVParallelLinear):
            return layer.shard_layout(shard_id)[3]  # type: ignore[arg-type]
        if isinstance(layer, MergedColumnParallelLinear) and isinstance(shard_id, int) \
                and 0 <= shard_id < len(layer.output_sizes):
            return layer.output_sizes[shard_id]
        raise ValueError(f"{layer.prefix}: shard_id={shard_id!r} is not a part of this layer")

    def _load_weight_scale(self, layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor,
                           shard_id: object) -> None:
        name = self._name(layer, "weight_scale", shard_id)
        if not loaded.is_floating_point():
            raise ValueError(f"{name}: checkpoint tensor has dtype {loaded.dtype}, expected a floating-point scale")
        rows = self._logical_rows(layer, shard_id)
        shape = tuple(loaded.shape)
        if self.is_per_tensor_weight:
            if loaded.numel() != 1:
                raise ValueError(f"{name}: checkpoint tensor has shape {shape}, expected one value (the weight "
                                 f"scheme's strategy is 'tensor')")
            loaded = torch.reshape(loaded, (1, 1)).float().expand(rows, 1)
        elif shape != (rows, 1):
            raise ValueError(f"{name}: checkpoint tensor has shape {shape}, expected ({rows}, 1) (the weight "
                             f"scheme's strategy is 'channel': one scale per output row)")
        if isinstance(layer, RowParallelLinear):
            with torch.no_grad():
                param.copy_(loaded)  # the output rows are whole on every rank
            return
        layer.weight_loader(param, loaded, shard_id)

    def _load_input_scale(self, layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor,
                          shard_id: object) -> None:
        name = self._name(layer, "input_scale", shard_id)
        if loaded.numel() != 1 or not loaded.is_floating_point():
            raise ValueError(f"{name}: checkpoint tensor has shape {tuple(loaded.shape)} and dtype {loaded.dtype}, "
                             f"expected one floating-point value (static per-tensor activation scale)")
        value = torch.reshape(loaded, (1,)).float()
        with torch.no_grad():
            param.copy_(torch.maximum(param, value))

    # ---- after loading ------------------------------------------------------------------------------------
    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Check the scales and derive the per-call forms of them (a [1, N] float32 row, a [N] model-dtype vector
        for the half-precision kernel)."""
        if layer.weight_read_elsewhere:
            raise ValueError(f"{layer.prefix}: its weight is read outside the layer's forward, which needs a float "
                             f"weight; list it in quantization_config.ignore")
        weight_scale = layer.weight_scale.detach()
        if not bool(torch.isfinite(weight_scale).all()) or bool((weight_scale < 0).any()):
            raise ValueError(f"{layer.prefix}.weight_scale: the checkpoint holds negative or non-finite scales")
        layer.weight_scale_row = weight_scale.reshape(1, -1).float().contiguous()
        layer.weight_scale_vector = weight_scale.reshape(-1).to(layer.params_dtype).contiguous()
        if self.is_static_input:
            input_scale = layer.input_scale.detach()
            if not bool(torch.isfinite(input_scale).all()) or not bool((input_scale > 0).all()):
                raise ValueError(f"{layer.prefix}.input_scale: the static activation scale must be positive and "
                                 f"finite, got {input_scale.tolist()}")

    # ---- compute ------------------------------------------------------------------------------------------
    def quantize_input(self, layer: LinearBase, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., K] -> (x_q int8 [..., K], x_scale float32 [..., 1] per token, or [1] static)."""
        if self.is_static_input:
            return quantize_per_tensor(x, layer.input_scale), layer.input_scale
        return quantize_per_token_traceable(x)

    @staticmethod
    def _native_kernel(x: torch.Tensor, dtype: torch.dtype) -> Any:
        if x.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return None
        return native_w8a8_linear()

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        input_size = x.shape[-1]
        native = None if is_tracing() else self._native_kernel(x, x.dtype)
        if native is not None:
            # Quantization in the kernel's prologue (a traced graph keeps it a node of its own: see below).
            input_scale = layer.input_scale if self.is_static_input else None
            output = native(x.reshape(-1, input_size), layer.weight, layer.weight_scale_row, input_scale, bias)
            return output.reshape(*x.shape[:-1], output.shape[-1])
        # Quantized before any reshape: in a traced graph the quantization then consumes the producer's output
        # directly (an RMSNorm's: the norm+quant fusion pass looks for exactly that).
        x_q, x_scale = self.quantize_input(layer, x)
        if not self.is_static_input:
            x_scale = x_scale.reshape(-1, 1)
        output = self.apply_quantized(layer, x_q.reshape(-1, input_size), x_scale, bias, x.dtype)
        return output.reshape(*x.shape[:-1], output.shape[-1])

    def apply_quantized(self, layer: LinearBase, x_q: torch.Tensor, x_scale: torch.Tensor,
                        bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The GEMM and epilogue on an already quantized input (the norm+quant fusion hands one over)."""
        native = self._native_kernel(x_q, dtype)
        if native is not None:
            return native(x_q, layer.weight, layer.weight_scale_row, x_scale, bias, dtype)
        if layer.weight_scale_vector.dtype == dtype and half_precision_kernel_fits(layer.weight, dtype):
            output = int8_matmul_scaled_half(x_q, layer.weight, layer.weight_scale_vector, dtype) * x_scale
        else:
            output = int8_matmul_exact(x_q, layer.weight).float() * x_scale * layer.weight_scale_row
        if bias is not None:
            output = output + bias
        return output.to(dtype)


def w8a8_reference_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          bias: torch.Tensor | None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Plain float32 W8A8: quantize x like the method (per token, or with the static `input_scale`), dequantize x
    and the int8 weight, F.linear. The oracle of the tests."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    if input_scale is None:
        scale = x2.abs().amax(dim=-1, keepdim=True) / 127
        x_dequantized = torch.round(x2 / torch.where(scale == 0, torch.ones_like(scale), scale)).clamp(-127, 127) * scale
    else:
        x_dequantized = torch.round(x2 / input_scale.float()).clamp(-128, 127) * input_scale.float()
    weight_dequantized = weight.float() * weight_scale.float().reshape(-1, 1)
    output = F.linear(x_dequantized, weight_dequantized, None if bias is None else bias.float())
    return output.reshape(*x.shape[:-1], -1)


__all__ = ["W8A8_INT8_LAYOUT", "W8A8Int8LinearMethod", "w8a8_reference_linear"]
