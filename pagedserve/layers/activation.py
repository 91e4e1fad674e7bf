"""Activations used by the dense MLPs."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """silu(x[..., :d]) * x[..., d:] for x of last dimension 2*d (the fused gate/up projection's output)."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return F.silu(x[..., :half]) * x[..., half:]
