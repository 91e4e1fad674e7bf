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


def _rotate_sized(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                  num_tokens: Any) -> torch.Tensor:
    """`_rotate` as Dynamo records it with a symbolic token count: `x.size()` kept whole, the count an input."""
    size = x.size()
    x = x.reshape(num_tokens, -1, head_dim)
    half = head_dim // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated_half * sin).reshape(size)


def _rotate_static(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                   num_tokens: int, width: int) -> torch.Tensor:
    """`_rotate` as Dynamo records it with static shapes: literal sizes, the final shape a literal tuple."""
    x = x.reshape(num_tokens, -1, head_dim)
    half = head_dim // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated_half * sin).reshape((num_tokens, width))


def _literal_token_counts(graph: fx.Graph) -> list[int]:
    """n of every `t.reshape(n, heads, head_dim)` with a literal n (static-shape Dynamo graphs)."""
    counts: dict[int, None] = {}
    for node in graph.nodes:
        if node.op == "call_method" and node.target == "reshape" and len(node.args) == 4 and \
                all(isinstance(arg, int) for arg in node.args[1:]) and node.args[2] > 0:
            counts[node.args[1]] = None
    return list(counts)


def _head_shapes(graph: fx.Graph) -> set[tuple[int, int]]:
    """(num_heads, head_dim) of every `t.reshape(n, num_heads, head_dim)` with literal head sizes."""
    shapes: set[tuple[int, int]] = set()
    for node in graph.nodes:
        if node.op == "call_method" and node.target == "reshape" and len(node.args) == 4 and \
                isinstance(node.args[2], int) and isinstance(node.args[3], int) and node.args[2] > 0:
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
            # Forms: False (symbolic_trace), True (Dynamo, symbolic token count), n (Dynamo, static n).
            forms: list[bool | int] = [False, True, *_literal_token_counts(graph)]
            for eps, dtype, form in itertools.product(eps_values, dtypes, forms):
                yield num_heads, num_kv_heads, head_dim, eps, dtype, form

    def pattern(self, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                dtype: torch.dtype | None, symbolic: bool | int = False) -> Callable[..., Any]:
        """`symbolic`: True for the Dynamo form with a symbolic token count (an extra input: the SymInt
        node); an int n for Dynamo's static form (literal sizes); False for the torch.fx.symbolic_trace
        form (`query.shape[0]`)."""
        if symbolic is not True and symbolic is not False:
            num_tokens = int(symbolic)

            def qk_norm_rope_static(query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor,
                                    k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
                query = _rms_norm(query.reshape(num_tokens, num_heads, head_dim), q_weight, eps, dtype)
                key = _rms_norm(key.reshape(num_tokens, num_kv_heads, head_dim), k_weight, eps, dtype)
                query = query.reshape(num_tokens, num_heads * head_dim)
                key = key.reshape(num_tokens, num_kv_heads * head_dim)
                cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
                return (_rotate_static(query, cos, sin, head_dim, num_tokens, num_heads * head_dim),
                        _rotate_static(key, cos, sin, head_dim, num_tokens, num_kv_heads * head_dim))

            return qk_norm_rope_static
        if symbolic:
            def qk_norm_rope_symbolic(query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor,
                                      k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                      num_tokens: Any) -> Any:
                query = _rms_norm(query.reshape(num_tokens, num_heads, head_dim), q_weight, eps, dtype)
                key = _rms_norm(key.reshape(num_tokens, num_kv_heads, head_dim), k_weight, eps, dtype)
                query = query.reshape(num_tokens, num_heads * head_dim)
                key = key.reshape(num_tokens, num_kv_heads * head_dim)
                cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
                return (_rotate_sized(query, cos, sin, head_dim, num_tokens),
                        _rotate_sized(key, cos, sin, head_dim, num_tokens))

            return qk_norm_rope_symbolic

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
                    dtype: torch.dtype | None, symbolic: bool | int = False) -> Callable[..., Any]:
        if symbolic is True:
            def fused_symbolic(query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor,
                               k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_tokens: Any) -> Any:
                result = torch.ops.pagedserve.qk_norm_rope.default(query, key, q_weight, k_weight, cos, sin,
                                                                   num_heads, num_kv_heads, head_dim, eps)
                return result[0], result[1]

            return fused_symbolic

        def fused(query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor) -> Any:
            result = torch.ops.pagedserve.qk_norm_rope.default(query, key, q_weight, k_weight, cos, sin,
                                                               num_heads, num_kv_heads, head_dim, eps)
            return result[0], result[1]

        return fused


__all__ = ["QKNormRopeFusionPass"]
