"""weight_layout='plain_native': float32 linears on plain weights, decode-sized batches on a native kernel.

A linear with a handful of rows streams its weight once per step; its speed is the memory bandwidth the loop
sustains. The native kernel (kernels/cpu/small_batch_linear.cpp, built into the CPU library with the
attention kernels) streams the plain [N, K] weight four rows at a time with software prefetch and reuses each
weight vector for every row: measured 1.03x / 1.16x / 1.64x / 1.63x / 1.36x the bandwidth of MKL's sgemm
(F.linear) at M = 1 / 2 / 4 / 8 / 16 with the weights in DRAM (26.0 vs 25.2 GB/s at M = 1, 19.5 vs 12.0 at
M = 8; benchmarks/small_batch_linear.py). One to three rows (batch-1 decode, decode steps of a
few requests) stream six weight rows (three rows: four) from as many stretches of a thread's share at once instead,
each front to back, without software prefetch (on a decode step's weights on an AMD Zen 4 VM: 1.15x at one row,
1.25x at two, 1.10x at three; bitwise the same results). On Intel CPUs batches above 16 rows (`INTEL_MAX_ROWS`: prefill
chunks, large decode batches) take F.linear, where MKL's blocking wins. Elsewhere the kernel takes up to
`MAX_ROWS` (128) rows, and larger batches take oneDNN's GEMM on the same plain weight (it reorders the weight
per call; no second copy): on AMD Zen 4 MKL's sgemm ran 1.05-1.25x slower than that at 32-2048 rows and 1.65x
slower for a 49152-column LM head at 64 rows (platforms/cpu_vendor.py), and the kernel, taking input rows five
at a time, ran 1.3x faster than oneDNN there at 24-64 rows and 1.12x at 128 (0.95x at 256) over SmolLM2-135M's
30 layers.

The weights are not copied or moved: the layout is 'plain' with another compute method, so everything that
reads `weight` keeps working. The LM head computes its logits the same way.

Numerics: a row's result depends only on K (fixed summation order, module docstring of the .cpp): batch and
thread invariant by itself, but not bitwise equal to MKL's sgemm; float32 greedy decoding is tested equal to
F.linear's. batch_invariant=True keeps F.linear everywhere (its mode reroutes F.linear to fixed row tiles,
and a request must not change kernel as the batch grows past native_max_rows()).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_library import load_native_op
from pagedserve.layers.linear import LinearMethodBase
from pagedserve.platforms.cpu_vendor import is_intel_cpu

PLAIN_NATIVE_LAYOUT = "plain_native"
# Largest batch (rows) the kernel takes (the op rejects more); off Intel the batches up to it run there.
MAX_ROWS = 128
# On Intel CPUs batches above this many rows take MKL's sgemm (F.linear), faster there.
INTEL_MAX_ROWS = 16

# None: not checked yet; then whether the kernel is built, loaded and compiled with its AVX-512 path.
_available: bool | None = None
_op: Any = None


def small_batch_linear_available() -> bool:
    """True when the native library is loaded (building it at first use) and has the kernel (AVX2 or AVX-512)."""
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


def native_max_rows() -> int:
    """Rows up to which a batch takes the kernel: INTEL_MAX_ROWS on Intel CPUs, MAX_ROWS elsewhere."""
    return INTEL_MAX_ROWS if is_intel_cpu() else MAX_ROWS


def qualifies(x: torch.Tensor) -> bool:
    """Whether x goes to the kernel: a 2-D float32 CPU batch of at most native_max_rows() rows with unit column
    stride, outside torch.compile tracing (inductor compiles F.linear itself)."""
    # Tracing first: dynamo cannot trace native_max_rows' first call (it reads /proc/cpuinfo).
    return not torch.compiler.is_compiling() and x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1 \
        and x.is_cpu and x.shape[0] <= native_max_rows()


def large_batches_on_onednn() -> bool:
    """Whether batches above native_max_rows() take oneDNN's GEMM (CPUs other than Intel's, with oneDNN) instead
    of F.linear."""
    return not is_intel_cpu() and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


def large_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T + bias for a batch the kernel does not take: oneDNN's GEMM where large_batches_on_onednn(),
    for 2-D float32 CPU inputs outside torch.compile tracing; F.linear otherwise."""
    if x.dim() == 2 and x.dtype == torch.float32 and x.is_cpu and not torch.compiler.is_compiling() \
            and large_batches_on_onednn():
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class SmallBatchLinearMethod(LinearMethodBase):
    """Plain float32 weight; batches of <= native_max_rows() rows on the native kernel, larger ones on
    large_batch_linear."""

    layout = PLAIN_NATIVE_LAYOUT

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if not layer.weight.is_contiguous():
            layer.weight.data = layer.weight.data.contiguous()

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if qualifies(x):
            return _op(x, layer.weight, bias)
        return large_batch_linear(x, layer.weight, bias)


SMALL_BATCH_LINEAR_METHOD = SmallBatchLinearMethod()

__all__ = ["INTEL_MAX_ROWS", "MAX_ROWS", "PLAIN_NATIVE_LAYOUT", "SMALL_BATCH_LINEAR_METHOD",
           "SmallBatchLinearMethod",
           "large_batch_linear", "large_batches_on_onednn", "native_max_rows", "qualifies", "small_batch_linear",
           "small_batch_linear_available"]
