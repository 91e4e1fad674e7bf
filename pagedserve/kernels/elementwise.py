"""The native fused elementwise CPU kernels (kernels/cpu/elementwise.cpp): RMSNorm, residual add + RMSNorm,
neox rotary embedding, SiLU-and-mul.

The kernels are compiled into the native CPU library with the attention kernels (kernels/cpu_library.py
builds it at first use). The layers (norm.py, rotary.py, activation.py) call them from `forward_cpu` when
`qualifies` / `matches` accept the inputs, and keep `forward_native` (the reference) otherwise; a failed build leaves
`native_elementwise_available()` False (one warning) and every layer on forward_native.

Numerics: bitwise equal to forward_native for float32 and bfloat16 — the kernels keep its rounding points and
sum the RMSNorm squares in ATen's order (the .cpp header lists them). One exception: ATen ends a SiLU row whose
length is not a multiple of its vector with a scalar exp that can differ in the last bit; the kernel computes
every element with the vector formula (as forward_native does under batch_invariant=True).

Batch invariance: each token is computed alone by one thread in a fixed order, so the kernels are batch
invariant by construction and stay on under batch_invariant=True (BatchInvariantMode passes these ops through).

Each op has a fake implementation, so FakeTensor / torch.compile tracing sees one opaque node. Inside
torch.compile and torch.fx tracing the layers use forward_native anyway (`qualifies` is False there): the fusion
passes (compilation/) match forward_native's op sequence, and inductor generates its own fused loops.
"""
from __future__ import annotations

import platform
from typing import Any

import torch

from pagedserve.kernels.cpu_library import is_native_extension_available

FLOAT_DTYPES = (torch.float32, torch.bfloat16)
POSITION_DTYPES = (torch.int64, torch.int32)


def aten_sum_vector_lanes() -> int:
    """Float lanes of the Vectorized<float> that ATen's `sum` kernel runs with on this machine: the RMSNorm
    kernel sums squares in that kernel's order (bitwise parity with forward_native's `mean`). On x86 it is 8
    whatever the CPU: ATen builds `sum` for AVX2 and the default capability (both 8 lanes) and registers no
    AVX-512 version (REGISTER_DISPATCH leaves it to the AVX2 one). Elsewhere 4 (NEON) is assumed; a wrong
    guess only costs last-bit parity, tests/layers/test_native_elementwise.py checks it bitwise."""
    return 8 if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686") else 4


REDUCTION_LANES = aten_sum_vector_lanes()

# None: not tried yet; then whether the kernels are loaded (and their fakes registered).
_available: bool | None = None


class _Ops:
    """The ops' OpOverloads, looked up once (calling `.default` skips overload resolution per call)."""

    rms_norm: Any = None
    add_rms_norm: Any = None
    rotary_embedding: Any = None
    silu_and_mul: Any = None


def _register_fakes() -> None:
    """Shape functions for FakeTensor / torch.compile; every output is a new contiguous tensor."""

    @torch.library.register_fake("pagedserve::cpu_rms_norm")
    def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float, reduction_lanes: int) -> torch.Tensor:
        return x.new_empty(x.shape)

    @torch.library.register_fake("pagedserve::cpu_add_rms_norm")
    def _add_rms_norm_fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           reduction_lanes: int) -> tuple[torch.Tensor, torch.Tensor]:
        return x.new_empty(x.shape), x.new_empty(x.shape)

    @torch.library.register_fake("pagedserve::cpu_rotary_embedding")
    def _rotary_embedding_fake(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                               cos_sin_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        return query.new_empty(query.shape), key.new_empty(key.shape)

    @torch.library.register_fake("pagedserve::cpu_silu_and_mul")
    def _silu_and_mul_fake(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def native_elementwise_available() -> bool:
    """True when the kernels are loaded (building the native library at first use); a failure is warned once
    (by kernels/cpu_library.py) and leaves the layers on forward_native."""
    global _available
    if _available is None:
        if is_native_extension_available():
            if _Ops.rms_norm is None:
                _register_fakes()
                ops = torch.ops.pagedserve
                _Ops.rms_norm = ops.cpu_rms_norm.default
                _Ops.add_rms_norm = ops.cpu_add_rms_norm.default
                _Ops.rotary_embedding = ops.cpu_rotary_embedding.default
                _Ops.silu_and_mul = ops.cpu_silu_and_mul.default
            _available = True
        else:
            _available = False
    return _available


def qualifies(x: Any) -> bool:
    """Whether the kernels can take x as their main input: a CPU tensor, float32 or bfloat16, with a contiguous
    last dimension, not requiring grad while grad mode is on (the ops have no autograd formula); and the kernels
    are available, outside torch.compile tracing. The other inputs are checked with `matches`.

    Called on every layer call, so it is kept to cheap attribute checks; devices of the other inputs and
    shapes are validated by the ops themselves (a mismatch raises, as forward_native does).
    """
    available = _available if _available is not None else native_elementwise_available()
    # is_compiling first: under Dynamo the tensor checks below would be traced into the graph (stride and
    # contiguity queries on symbolic shapes) and break the fusion passes' patterns. A torch.fx Proxy
    # (symbolic tracing) is not a Tensor: tracing keeps the plain ops too.
    return available and not torch.compiler.is_compiling() and isinstance(x, torch.Tensor) and x.is_cpu \
        and x.dtype in FLOAT_DTYPES and (x.is_contiguous() or x.stride(-1) == 1) \
        and not (x.requires_grad and torch.is_grad_enabled())


def matches(other: Any, x: torch.Tensor) -> bool:
    """Whether `other` can go with a qualifying x into one op: a tensor of x's dtype with a contiguous last
    dimension, not requiring grad while grad mode is on."""
    return isinstance(other, torch.Tensor) and other.dtype == x.dtype \
        and (other.is_contiguous() or other.stride(-1) == 1) and not (other.requires_grad and torch.is_grad_enabled())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) over the last dimension (RMSNorm.forward_native without a residual)."""
    if x.dim() > 3:
        return _Ops.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps, REDUCTION_LANES).view(x.shape)
    return _Ops.rms_norm(x, weight, eps, REDUCTION_LANES)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual): RMSNorm.forward_native with a residual. New tensors:
    x and residual are not written (callers may keep using them)."""
    if x.dim() > 3:
        width = x.shape[-1]
        output, summed = _Ops.add_rms_norm(x.reshape(-1, width), residual.reshape(-1, width), weight, eps,
                                           REDUCTION_LANES)
        return output.view(x.shape), summed.view(x.shape)
    return _Ops.add_rms_norm(x, residual, weight, eps, REDUCTION_LANES)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
                     head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox RoPE of query and key ([tokens, heads * head_dim] or [tokens, heads, head_dim], any row strides)
    with the rows of `cos_sin_cache` (float32 [max_positions, head_dim]: cos half, sin half) at `positions`.
    Returns new contiguous tensors of the inputs' shapes. A position outside the table raises RuntimeError."""
    query_in = query if query.dim() == 2 or (query.dim() == 3 and query.shape[-1] == head_dim) \
        else query.reshape(query.shape[0], -1, head_dim)
    key_in = key if key.dim() == 2 or (key.dim() == 3 and key.shape[-1] == head_dim) \
        else key.reshape(key.shape[0], -1, head_dim)
    if positions.dim() != 1:
        positions = positions.reshape(-1)
    query_out, key_out = _Ops.rotary_embedding(positions, query_in, key_in, cos_sin_cache, head_dim)
    if query_in is not query:
        query_out = query_out.view(query.shape)
    if key_in is not key:
        key_out = key_out.view(key.shape)
    return query_out, key_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x [..., 2 * d]."""
    if x.dim() <= 2:
        return _Ops.silu_and_mul(x)
    return _Ops.silu_and_mul(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], x.shape[-1] // 2)


__all__ = ["FLOAT_DTYPES", "POSITION_DTYPES", "REDUCTION_LANES", "add_rms_norm", "aten_sum_vector_lanes",
           "matches", "native_elementwise_available", "qualifies", "rms_norm", "rotary_embedding", "silu_and_mul"]
