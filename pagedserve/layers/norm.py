"""RMSNorm with an optional fused residual add."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels import elementwise as native_elementwise
from pagedserve.layers.custom_op import CustomOp
from pagedserve.layers.weight_loading import default_weight_loader


class RMSNorm(CustomOp):
    """y = weight * x / sqrt(mean(x^2) + eps), with the statistics computed in float32.

    With `residual` given, computes `x = x + residual` first and returns `(norm(x), x)`: the sum becomes
    the residual stream for the next block (same order of operations as HF's decoder layers).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        input_dtype = x.dtype
        hidden = x.to(torch.float32)
        variance = hidden.pow(2).mean(dim=-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
        # Cast back before the weight multiply, as HF does, so low-precision results match bit for bit.
        output = self.weight * hidden.to(input_dtype)
        return output if residual is None else (output, residual)

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One native kernel (kernels/cpu/elementwise.cpp) instead of forward_native's ~8 ops, bitwise equal
        to it; forward_native when the inputs do not qualify (dtype, layout, tracing, no native build).

        The kernel returns new tensors and never writes x or residual (Qwen3 passes a view of the qkv output).
        It computes each token alone in a fixed order, hence is batch invariant and stays on under
        batch_invariant=True.
        """
        if native_elementwise.qualifies(x):
            weight = self.weight
            if native_elementwise.matches(weight, x):
                if residual is None:
                    return native_elementwise.rms_norm(x, weight, self.variance_epsilon)
                if native_elementwise.matches(residual, x) and residual.shape == x.shape:
                    return native_elementwise.add_rms_norm(x, residual, weight, self.variance_epsilon)
        return self.forward_native(x, residual)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.variance_epsilon}"
