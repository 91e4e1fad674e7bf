"""Activations used by the dense MLPs."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels import elementwise as native_elementwise
from pagedserve.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """silu(x[..., :d]) * x[..., d:] for x of last dimension 2*d (the fused gate/up projection's output)."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return F.silu(x[..., :half]) * x[..., half:]

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """One native kernel (kernels/cpu/elementwise.cpp): silu rounded to the dtype, then the product, as
        forward_native; every element through the vector exp (bitwise equal to forward_native except, for
        a row length that is not a multiple of ATen's vector, the last bit of its scalar tail). Per token,
        so batch invariant (kept on under batch_invariant=True)."""
        if native_elementwise.qualifies(x) and x.shape[-1] % 2 == 0:
            return native_elementwise.silu_and_mul(x)
        return self.forward_native(x)
