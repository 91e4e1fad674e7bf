"""QKNormRopeFusionPass: per-head q/k RMSNorm + neox RoPE (Qwen3) -> pagedserve::qk_norm_rope.

Matches the op sequence of `Qwen3Attention.normalize_query_key` (models/qwen3.py: reshape to heads,
`RMSNorm.forward_native` on q and k, reshape back) followed by `RotaryEmbedding.forward_native` once its
cos/sin rows are gathered (layers/rotary.py: unsqueeze over heads, `_rotate` of q and k). cos and sin
are inputs of the pattern: their gather is shared by every layer and stays outside the fused op.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import fx

from pagedserve.compilation import fused_operators  # noqa: F401  (registers torch.ops.pagedserve.*)
from pagedserve.compilation.fusion_pass import FusionPass, cast_back, cast_back_dtypes, rms_norm_eps_values


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype | None) -> torch.Tensor:
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(dim=-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * cast_back(hidden, x, dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    shape = x.shape
    x = x.reshape(shape[0], -1, head_dim)
    half = head_dim // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated_half * sin).reshape(shape)


def _head_shapes(graph: fx.Graph) -> set[tuple[int, int]]:
    """(num_heads, head_dim) of every `t.reshape(n, num_heads, head_dim)` with literal head sizes."""
    shapes: set[tuple[int, int]] = set()
    for node in graph.nodes:
        if node.op == "call_method" and node.target == "reshape" and len(node.args) == 4 and \
                isinstance(node.args[2], int) and isinstance(node.args[3], int):
            shapes.add((node.args[2], node.args[3]))
    return shapes


class QKNormRopeFusionPass(FusionPass):
    name = "fuse_qknorm_rope"

    def candidate_parameters(self, graph: fx.Graph) -> Iterable[tuple[Any, ...]]:
        shapes = _head_shapes(graph)
        if not shapes:
            return
        eps_values = rms_norm_eps_values(graph)
        dtypes = cast_back_dtypes(graph)
        for (num_heads, head_dim), (num_kv_heads, kv_head_dim) in itertools.product(sorted(shapes), repeat=2):
            if head_dim != kv_head_dim or head_dim % 2:
                continue
            for eps, dtype in itertools.product(eps_values, dtypes):
                yield num_heads, num_kv_heads, head_dim, eps, dtype

    def pattern(self, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                dtype: torch.dtype | None) -> Callable[..., Any]:
        def qk_norm_rope(query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor) -> Any:
            num_tokens = query.shape[0]
            query = _rms_norm(query.reshape(num_tokens, num_heads, head_dim), q_weight, eps, dtype)
            key = _rms_norm(key.reshape(num_tokens, num_kv_heads, head_dim), k_weight, eps, dtype)
            query = query.reshape(num_tokens, num_heads * head_dim)
            key = key.reshape(num_tokens, num_kv_heads * head_dim)
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
            return _rotate(query, cos, sin, head_dim), _rotate(key, cos, sin, head_dim)

        return qk_norm_rope

    def replacement(self, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                    dtype: torch.dtype | None) -> Callable[..., Any]:
        def fused(query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor) -> Any:
            result = torch.ops.pagedserve.qk_norm_rope.default(query, key, q_weight, k_weight, cos, sin,
                                                               num_heads, num_kv_heads, head_dim, eps)
            return result[0], result[1]

        return fused


__all__ = ["QKNormRopeFusionPass"]
