"""Transcendental elementwise ops computed so that every element takes the vectorised path.

Why: ATen's CPU loops run whole vectors (2 x Vectorized<T>::size() elements at a time) and finish a
range with the scalar function, and a large tensor's flat range is split between threads at offsets
that depend on its size. For some functions the two paths disagree in the last bit (measured on this
build: float32 `silu` and `sigmoid`, about 4% of inputs), so whether a token's element lands in a
vector or in a tail — which depends on how many other tokens share the tensor — would change its bits.

How: the flat input is zero-padded to a multiple of VECTOR_SPAN elements and the function runs on
pieces of PIECE_ELEMENTS (a multiple of VECTOR_SPAN, below ATen's 32768-element parallel grain, so each
piece is one single-threaded, tail-free loop). Every element then goes through the vector function.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

# 2 x the widest Vectorized<T>::size() on AVX-512 (32 bfloat16 lanes): a loop step never leaves a tail.
VECTOR_SPAN = 64
# Elements per call: below at::internal::GRAIN_SIZE (32768), so ATen never splits a call between threads.
PIECE_ELEMENTS = 16384


def vector_path_unary(function: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any,
                      **kwargs: Any) -> torch.Tensor:
    """function(x, *args, **kwargs) for an elementwise function, every element on the vector path."""
    num_elements = x.numel()
    if num_elements == 0:
        return function(x, *args, **kwargs)
    padded_size = -(-num_elements // VECTOR_SPAN) * VECTOR_SPAN
    padded = x.new_zeros(padded_size)
    padded[:num_elements].copy_(x.reshape(-1))
    pieces = [function(piece, *args, **kwargs) for piece in padded.split(PIECE_ELEMENTS)]
    output = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return output[:num_elements].view(x.shape)


__all__ = ["PIECE_ELEMENTS", "VECTOR_SPAN", "vector_path_unary"]
