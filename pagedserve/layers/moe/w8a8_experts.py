"""W8A8 int8 routed experts (vllm-ascend's MoE w8a8_dynamic flow, algorithm notes M6 and M9).

Stacked per expert slot like the float experts (layers/moe/fused_experts.py): w13 int8 [slots, 2I, H] with
w13_scale float32 [slots, 2I, 1], w2 int8 [slots, H, I] with w2_scale [slots, H, 1] (per output channel).

The rows are quantized per token once, where they are grouped by slot (the dispatch quantization). Per slot:
GMM1 = int8 gate_up GEMM (int32 accumulators); then `swiglu_quant`, the gmm_swiglu_quant epilogue in one pass:
dequantize with x_scale * w13_scale, SwiGLU, and re-quantize the down projection's input per token; GMM2 = int8
down GEMM, dequantized with its per-token and per-channel scales. `reference_w8a8_experts` is the plain float32
dequantize-then-run oracle.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.layers.quantization.int8_matmul import int8_matmul_exact, quantize_per_token


def swiglu_quant(accumulators: torch.Tensor, x_scale: torch.Tensor,
                 w13_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 gate|up accumulators [n, 2I] -> (int8 silu(gate) * up [n, I], its per-token scale [n, 1]);
    w13_scale [2I, 1]."""
    gate_up = accumulators.float() * x_scale * w13_scale.reshape(1, -1)
    intermediate = gate_up.shape[-1] // 2
    return quantize_per_token(F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:])


def grouped_swiglu_experts_w8a8(rows: torch.Tensor, counts: list[int], w13: torch.Tensor, w13_scale: torch.Tensor,
                                w2: torch.Tensor, w2_scale: torch.Tensor) -> torch.Tensor:
    """Each slot's contiguous range of `rows` (sorted by slot) through that slot's W8A8 SwiGLU MLP; unweighted
    outputs [num_rows, hidden] in the rows' dtype."""
    output = torch.empty_like(rows)
    x_q, x_scale = quantize_per_token(rows)
    start = 0
    for slot, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        activated_q, activated_scale = swiglu_quant(int8_matmul_exact(x_q[start:end], w13[slot]),
                                                    x_scale[start:end], w13_scale[slot])
        down = int8_matmul_exact(activated_q, w2[slot]).float() * activated_scale * w2_scale[slot].reshape(1, -1)
        output[start:end] = down.to(rows.dtype)
        start = end
    return output


def _fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    x_q, scale = quantize_per_token(x)
    return x_q.float() * scale


def reference_w8a8_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                           w2: torch.Tensor, w2_scale: torch.Tensor, topk_weights: torch.Tensor,
                           slot_ids: torch.Tensor) -> torch.Tensor:
    """Dense float32 oracle: every expert on every token with dequantized weights and fake-quantized inputs."""
    intermediate = w2.shape[-1]
    x = _fake_quantize_per_token(hidden_states.float())
    output = torch.zeros_like(hidden_states, dtype=torch.float32)
    for slot in range(w13.shape[0]):
        gate_up = x @ (w13[slot].float() * w13_scale[slot]).T
        activated = _fake_quantize_per_token(F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:])
        expert_out = activated @ (w2[slot].float() * w2_scale[slot]).T
        output += (topk_weights * (slot_ids == slot)).sum(dim=-1, keepdim=True).float() * expert_out
    return output.to(hidden_states.dtype)


__all__ = ["grouped_swiglu_experts_w8a8", "reference_w8a8_experts", "swiglu_quant"]
