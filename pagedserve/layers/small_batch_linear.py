"""weight_layout='plain_native': float32 linears on plain weights, decode-sized batches on a native kernel.

A linear with a handful of rows streams its weight once per step; its speed is the memory bandwidth the loop
sustains. The native kernel (layers/native/small_batch_linear.cpp, built into the CPU library with the
attention kernels) streams the plain [N, K] weight four rows at a time with software prefetch and reuses each
weight vector for every row: measured 1.03x / 1.16x / 1.64x / 1.63x / 1.36x the bandwidth of MKL's sgemm
(F.linear) at M = 1 / 2 / 4 / 8 / 16 with the weights in DRAM (26.0 vs 25.2 GB/s at M = 1, 19.5 vs 12.0 at
M = 8; benchmarks/small_batch_linear.py). Batches above `MAX_ROWS` rows (prefill chunks, large decode
batches) keep F.linear, where MKL's blocking wins.

The weights are not copied or moved: the layout is 'plain' with another compute method, so everything that
reads `weight` keeps working. The LM head computes its logits the same way.

Numerics: a row's result depends only on K (fixed summation order, module docstring of the .cpp): batch and
thread invariant by itself, but not bitwise equal to MKL's sgemm; float32 greedy decoding is tested equal to
F.linear's. batch_invariant=True keeps F.linear everywhere (its mode reroutes F.linear to fixed row tiles,
and a request must not change kernel as the batch grows past MAX_ROWS).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagedserve.attention.cpu_native_extension import load_native_op
from pagedserve.layers.linear import LinearMethodBase

PLAIN_NATIVE_LAYOUT = "plain_native"
# Largest batch (rows) the kernel takes; the op rejects more. Above it F.linear (MKL) is faster.
MAX_ROWS = 16

# None: not checked yet; then whether the kernel is built, loaded and compiled with its AVX-512 path.
_available: bool | None = None
_op: Any = None


def small_batch_linear_available() -> bool:
    """True when the native library is loaded (building it at first use) and has the AVX-512 kernel."""
    global _available, _op
    if _available is None:
        _op = load_native_op("small_batch_linear", "is_small_batch_linear_supported", _small_batch_linear_fake)
        _available = _op is not None
    return _available


def _small_batch_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T + bias on the native kernel: x [M <= MAX_ROWS, K] float32 with unit column stride, weight
    [N, K] contiguous float32 (callers check with `qualifies`)."""
    return _op(x, weight, bias)


def qualifies(x: torch.Tensor) -> bool:
    """Whether x goes to the kernel: a 2-D float32 CPU batch of at most MAX_ROWS rows with unit column stride,
    outside torch.compile tracing (inductor compiles F.linear itself)."""
    return x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == torch.float32 and x.stride(1) == 1 \
        and x.is_cpu and not torch.compiler.is_compiling()


class SmallBatchLinearMethod(LinearMethodBase):
    """Plain float32 weight; batches of <= MAX_ROWS rows on the native kernel, larger ones on F.linear."""

    layout = PLAIN_NATIVE_LAYOUT

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if not layer.weight.is_contiguous():
            layer.weight.data = layer.weight.data.contiguous()

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if qualifies(x):
            return _op(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)


SMALL_BATCH_LINEAR_METHOD = SmallBatchLinearMethod()

__all__ = ["MAX_ROWS", "PLAIN_NATIVE_LAYOUT", "SMALL_BATCH_LINEAR_METHOD", "SmallBatchLinearMethod", "qualifies",
           "small_batch_linear", "small_batch_linear_available"]
