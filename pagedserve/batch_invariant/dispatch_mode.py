"""BatchInvariantMode: a TorchDispatchMode that reroutes batch-dependent ATen ops to invariant forms.

Active only while the engine's step runs with batch_invariant=True (worker/model_runner.py enters it
through pagedserve.batch_invariant.step_mode); layers stay plain PyTorch and the mode sees the ATen ops
they call (under inference mode the mode sees F.linear and torch.matmul before they decompose, and
mm / addmm / bmm when they are called directly).

- linear, matmul (2-D right operand, or 3-D @ 3-D), mm, addmm, bmm: fixed-shape row tiles (matmul.py).
- sum / mean that reduce a tensor to a single value over >= 32768 elements: ATen splits such a reduction
  between threads (two passes), while the same row inside a batch is reduced by one thread; the mode
  adds a zero row so that the single-row case is reduced like a row of a batch.
- silu, sigmoid, exp, tanh, gelu, log (and in-place forms): every element on the vector path
  (elementwise.py).
- Ops with no invariant form here (CPU SDPA kernels, mkldnn packed-weight linears, int8 GEMMs) raise,
  so a path the mode does not cover fails loudly instead of silently depending on the batch.

Other reductions used by the models and the sampler (softmax, log_softmax, max, topk, row sums and means
over fewer elements, cumsum) reduce each row alone in a fixed order: measured invariant, see
tests/batch_invariant/test_reductions.py.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from pagedserve.batch_invariant.elementwise import vector_path_unary
from pagedserve.batch_invariant.matmul import (
    batch_invariant_addmm,
    batch_invariant_bmm,
    batch_invariant_mm,
)

aten = torch.ops.aten

# ATen splits a reduction to one value between threads from this many elements (at::internal::GRAIN_SIZE).
_PARALLEL_REDUCTION_ELEMENTS = 32768

_REDUCTION_OPS = (aten.sum.dim_IntList, aten.mean.dim, aten.sum.default, aten.mean.default)
_VECTOR_PATH_OPS = {
    aten.silu.default: aten.silu.default,
    aten.sigmoid.default: aten.sigmoid.default,
    aten.exp.default: aten.exp.default,
    aten.tanh.default: aten.tanh.default,
    aten.gelu.default: aten.gelu.default,
    aten.log.default: aten.log.default,
}
_VECTOR_PATH_INPLACE_OPS = {
    aten.silu_.default: aten.silu.default,
    aten.sigmoid_.default: aten.sigmoid.default,
    aten.exp_.default: aten.exp.default,
    aten.tanh_.default: aten.tanh.default,
    aten.gelu_.default: aten.gelu.default,
    aten.log_.default: aten.log.default,
}
_UNSUPPORTED_OP_NAMES = (
    "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_attention_math",
    "aten::_scaled_dot_product_fused_attention_overrideable",
    "aten::baddbmm",
    "aten::_int_mm",
    "aten::_weight_int8pack_mm",
    "aten::_weight_int4pack_mm_for_cpu",
    "aten::mkldnn_linear",
    "aten::matmul",
    "aten::einsum",
)


def _is_unsupported(func: torch._ops.OpOverload) -> bool:
    name = func._schema.name
    return name in _UNSUPPORTED_OP_NAMES or name.startswith("mkldnn::")


def _single_value_reduction(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """sum/mean of a big floating tensor down to one value, reduced as row 0 of a two-row batch (so
    that ATen reduces it whole in one thread, as it does a row among others). None: not that case."""
    x = args[0]
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() < _PARALLEL_REDUCTION_ELEMENTS:
        return None
    if func in (aten.sum.default, aten.mean.default):
        dims, keepdim = [], False
        dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
    else:
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        dtype = args[3] if len(args) > 3 else kwargs.get("dtype")
        dims = [dims] if isinstance(dims, int) else list(dims or [])
    reduced = {d % x.dim() for d in dims} if dims else set(range(x.dim()))
    if any(x.shape[d] != 1 for d in range(x.dim()) if d not in reduced):
        return None  # several outputs: ATen splits the outputs between threads, each reduced whole
    rows = torch.zeros(2, x.numel(), dtype=x.dtype, device=x.device)
    rows[0].copy_(x.reshape(-1))
    row_reduction = aten.mean.dim if func in (aten.mean.dim, aten.mean.default) else aten.sum.dim_IntList
    value = row_reduction(rows, [1], False, dtype=dtype)[0]
    shape = [1 if d in reduced else x.shape[d] for d in range(x.dim())] if keepdim else \
        [x.shape[d] for d in range(x.dim()) if d not in reduced]
    return value.reshape(shape)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over the rows of x [..., K]."""
    rows = x.reshape(-1, x.shape[-1])
    output = batch_invariant_mm(rows, weight.t()) if bias is None else batch_invariant_addmm(bias, rows, weight.t())
    return output.view(*x.shape[:-1], weight.shape[0])


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul for a [..., M, K] @ b [K, N] and a [B, M, K] @ b [B, K, N]."""
    if b.dim() == 2:
        return batch_invariant_mm(a.reshape(-1, a.shape[-1]), b).view(*a.shape[:-1], b.shape[1])
    return batch_invariant_bmm(a, b)


@contextmanager
def outside_batch_invariant_mode() -> Iterator[None]:
    """Suspends the active dispatch modes (this one) for code that is batch invariant by construction."""
    with _disable_current_modes():
        yield


class BatchInvariantMode(TorchDispatchMode):
    """Within this mode, the ops a model step uses give each row (token) the same bits whatever the
    other rows are; see the module docstring for the list and the reasons."""

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is aten.linear.default:
            return _linear(*args, **kwargs)
        if func is aten.matmul.default and (args[1].dim() == 2 or (args[0].dim() == 3 and args[1].dim() == 3)):
            return _matmul(*args)
        if func is aten.mm.default:
            return batch_invariant_mm(*args)
        if func is aten.addmm.default:
            return batch_invariant_addmm(*args, **kwargs)
        if func is aten.bmm.default:
            return batch_invariant_bmm(*args)
        if func in _REDUCTION_OPS:
            result = _single_value_reduction(func, args, kwargs)
            if result is not None:
                return result
        elif func in _VECTOR_PATH_OPS and args[0].is_floating_point():
            return vector_path_unary(_VECTOR_PATH_OPS[func], *args, **kwargs)
        elif func in _VECTOR_PATH_INPLACE_OPS and args[0].is_floating_point():
            return args[0].copy_(vector_path_unary(_VECTOR_PATH_INPLACE_OPS[func], *args, **kwargs))
        elif _is_unsupported(func):
            raise RuntimeError(f"batch_invariant=True has no batch-invariant form of {func._schema.name}; "
                               f"this path must run outside the mode or be given one")
        return func(*args, **kwargs)


__all__ = ["BatchInvariantMode", "outside_batch_invariant_mode"]
