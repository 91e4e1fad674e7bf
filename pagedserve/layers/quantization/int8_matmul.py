"""Int8 activation quantization and the int8 x int8 GEMMs of W8A8 linear layers.

Activations are quantized symmetrically to [-127, 127] (per-token dynamic: scale = absmax / 127 per row, as vLLM's
`scaled_int8_quant`) or to [-128, 127] with a static per-tensor scale (round half to even, then clamp).

Two GEMMs compute sum_k x_q[m, k] * w_q[n, k]:
- `int8_matmul_exact`: torch._int_mm, int32 accumulators, bitwise those of an integer matmul. Every dtype and
  shape; on the CPU torch's int8 GEMM is a portable loop (slow), so it serves float32 models and the tests.
- `int8_matmul_scaled_half`: torch._weight_int8pack_mm on the CPU for bfloat16/float16 models: the int8 weight
  stays int8 in memory (half the bytes of a bf16 weight), the quantized activation is passed as bfloat16 holding
  the same integers (exact: |x_q| <= 128 fits bf16's 8-bit significand), the kernel accumulates in float32 and
  applies the per-channel weight scale before rounding to the model dtype. Torch's kernel reads K in steps of 8
  without a tail (K = 30 crashed the process in torch 2.13), hence `half_precision_kernel_fits`.

Where the native library runs, `native_w8a8_linear` does the whole layer in one op (kernels/cpu/int8_linear.cpp):
the quantization in its prologue, exact int32 products, the float32 epilogue rounded once to the model dtype;
bitwise `int8_matmul_exact(x_q, w).float() * x_scale * w_scale + bias` for float32 and bfloat16 activations.
"""
from __future__ import annotations

from typing import Any

import torch

from pagedserve.kernels.cpu_library import load_native_op

INT8_MAX = 127
INT8_MIN = -128
# torch._int_mm on CUDA needs more than 16 rows; smaller batches are padded there.
_CUDA_INT_MM_MIN_ROWS = 17
# torch._weight_int8pack_mm's CPU kernel needs the reduction size to be a multiple of this.
_HALF_KERNEL_K_MULTIPLE = 8


# The native op once looked up: None until then, False where it cannot run.
_native_op: Any = None


def _w8a8_linear_fake(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      input_scale: torch.Tensor | None, bias: torch.Tensor | None,
                      out_dtype: torch.dtype | None = None, products: str = "auto") -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype or x.dtype)


def native_w8a8_linear() -> Any:
    """`pagedserve::w8a8_linear(x, weight, weight_scale, input_scale, bias, out_dtype)` where the native library
    runs (building it at first use), else None. x [M, K] float32/bfloat16 is quantized inside (per token when
    input_scale is None, else with the static one-value scale); an int8 x is already quantized and input_scale
    holds its scales ([M, 1] or one value). `products` ('auto') names the product unit, one of
    `torch.ops.pagedserve.w8a8_linear_products()` (amx, avx512_vnni, int16): every unit gives the same bits."""
    global _native_op
    if _native_op is None:
        _native_op = load_native_op("w8a8_linear", "is_w8a8_linear_supported", _w8a8_linear_fake) or False
    return _native_op or None


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q int8 [M, K], scale float32 [M, 1]) with scale = max|x_row| / 127 and
    x_q = round(x / scale) (an all-zero row gets scale 0 and x_q 0)."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    safe_scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    x_q = torch.round(x32 / safe_scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return x_q, scale


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> int8 round(x / scale) clamped to [-128, 127], `scale` a float32 one-element tensor."""
    return torch.round(x.float() / scale).clamp_(INT8_MIN, INT8_MAX).to(torch.int8)


def int8_matmul_exact(x_q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """int32 [M, N] = x_q [M, K] int8 @ weight [N, K] int8 ^T, exactly."""
    num_rows = x_q.shape[0]
    if x_q.is_cuda and num_rows < _CUDA_INT_MM_MIN_ROWS:
        padded = x_q.new_zeros(_CUDA_INT_MM_MIN_ROWS, x_q.shape[1])
        padded[:num_rows] = x_q
        return torch._int_mm(padded, weight.t())[:num_rows]
    return torch._int_mm(x_q, weight.t())


def half_precision_kernel_fits(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `int8_matmul_scaled_half` can run a `dtype` activation against `weight` [N, K] int8."""
    return (weight.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
            and weight.shape[1] % _HALF_KERNEL_K_MULTIPLE == 0)


def int8_matmul_scaled_half(x_q: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            dtype: torch.dtype) -> torch.Tensor:
    """[M, N] in `dtype` = (x_q @ weight^T) * weight_scale, accumulated in float32 (see the module docstring);
    weight_scale [N] in `dtype`. Requires half_precision_kernel_fits."""
    return torch._weight_int8pack_mm(x_q.to(dtype), weight, weight_scale)


__all__ = ["INT8_MAX", "INT8_MIN", "half_precision_kernel_fits", "int8_matmul_exact", "int8_matmul_scaled_half",
           "native_w8a8_linear", "quantize_per_tensor", "quantize_per_token"]
