"""Fused operators targeted by the fusion passes: one `torch.library` custom op each.

Every op has a plain-PyTorch reference (`*_reference`, the unfused op sequence: the test oracle) and a
fused body registered as the op's implementation. On the CPU the fused body is one function the
compiler sees as a unit (one graph node), computing the same math with fewer materialised
intermediates; a platform with its own kernel (Triton, a vendor op) registers it for its dispatch key
without touching the passes. Each op also has a fake (meta) implementation so torch.compile can trace
graphs that contain it.
"""
from __future__ import annotations

import torch
from torch.library import custom_op, register_fake

from pagedserve.kernels import elementwise as native_elementwise
from pagedserve.layers.quantization.int8_matmul import quantize_per_token

# ---------------------------------------------------------------- residual add + RMSNorm


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual), statistics in float32 (layers/norm.py order)."""
    summed = x + residual
    hidden = summed.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * hidden.to(summed.dtype), summed


@custom_op("pagedserve::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # On the CPU, the native kernel that eager RMSNorm uses (one pass, bitwise equal to the reference; its
    # outputs are fresh tensors, as a custom op's must be). Without it the graph ran these ATen ops at ~85 us a
    # call, where eager took one native call.
    if (native_elementwise.qualifies(x) and native_elementwise.matches(weight, x)
            and native_elementwise.matches(residual, x) and residual.shape == x.shape):
        return native_elementwise.add_rms_norm(x, residual, weight, eps)
    summed = torch.add(x, residual)
    hidden = summed.to(torch.float32)  # may alias `summed` (float32): never written in place
    normalized = hidden * torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True).add_(eps))
    # `normalized` is a fresh tensor: the weight multiply reuses its storage instead of a new output.
    return normalized.to(summed.dtype).mul_(weight), summed


@register_fake("pagedserve::fused_add_rms_norm")
def _fused_add_rms_norm_fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


# ---------------------------------------------------------------- residual add + RMSNorm + per-token int8 quant


def add_rms_norm_quant_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 per-token quantization of weight * rmsnorm(x + residual), its float32 scale [.., 1], x + residual):
    what a W8A8 dynamic linear consuming the norm's output computes first (layers/quantization/)."""
    normed, summed = add_rms_norm_reference(x, residual, weight, eps)
    x_q, scale = quantize_per_token(normed)
    return x_q, scale, summed


@custom_op("pagedserve::fused_add_rms_norm_quant", mutates_args=())
def fused_add_rms_norm_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The norm's output is quantized as soon as it is made and never leaves this op (no graph value, no
    # allocation the compiler must keep); bitwise the unfused pair (fused_add_rms_norm, then the per-token quant).
    normed, summed = fused_add_rms_norm(x, residual, weight, eps)
    x_q, scale = quantize_per_token(normed)
    return x_q, scale, summed


@register_fake("pagedserve::fused_add_rms_norm_quant")
def _fused_add_rms_norm_quant_fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty_like(x, dtype=torch.int8), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32),
            torch.empty_like(x))


# ---------------------------------------------------------------- per-head q/k RMSNorm + RoPE


def _rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def _rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def qk_norm_rope_reference(query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                           head_dim: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's attention prologue: per-head RMSNorm of q [n, H*D] and k [n, Hkv*D], then neox RoPE with
    cos/sin [n, D] (halves repeated). Returns q and k in their input shapes."""
    num_tokens = query.shape[0]
    q = _rms_norm_heads(query.reshape(num_tokens, num_heads, head_dim), q_weight, eps)
    k = _rms_norm_heads(key.reshape(num_tokens, num_kv_heads, head_dim), k_weight, eps)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return (_rope_neox(q, cos, sin).reshape(num_tokens, num_heads * head_dim),
            _rope_neox(k, cos, sin).reshape(num_tokens, num_kv_heads * head_dim))


@custom_op("pagedserve::qk_norm_rope", mutates_args=())
def qk_norm_rope(query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # One op for the whole prologue: cos/sin are broadcast once for q and k, and each head block is
    # normalised and rotated without the reshape round trips of the unfused graph.
    num_tokens = query.shape[0]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    q = _rope_neox(_rms_norm_heads(query.reshape(num_tokens, num_heads, head_dim), q_weight, eps), cos, sin)
    k = _rope_neox(_rms_norm_heads(key.reshape(num_tokens, num_kv_heads, head_dim), k_weight, eps), cos, sin)
    return q.view(num_tokens, num_heads * head_dim), k.view(num_tokens, num_kv_heads * head_dim)


@register_fake("pagedserve::qk_norm_rope")
def _qk_norm_rope_fake(query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(query), torch.empty_like(key)


# ---------------------------------------------------------------- x * scale + y


def muls_add_reference(x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    return x * scale + y


@custom_op("pagedserve::muls_add", mutates_args=())
def muls_add(x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    # One pass, no `x * scale` intermediate (may round once instead of twice: close, not bitwise).
    return torch.add(y, x, alpha=scale)


@register_fake("pagedserve::muls_add")
def _muls_add_fake(x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(torch.broadcast_tensors(x, y)[0])


__all__ = ["add_rms_norm_quant_reference", "add_rms_norm_reference", "fused_add_rms_norm", "fused_add_rms_norm_quant", "muls_add", "muls_add_reference", "qk_norm_rope",
           "qk_norm_rope_reference"]
