"""Routed-expert computation on stacked weights: the grouped (fused) path and the dense reference.

Weights are stacked per expert slot: w13 [num_slots, 2 * intermediate, hidden] (gate rows then up rows)
and w2 [num_slots, hidden, intermediate]. A token routed to slot s with weight g contributes
g * w2[s] @ (silu(gate) * up) with gate|up = w13[s] @ x.

Grouped path: the (token, k) pairs are sorted by slot once (a stable argsort), so every slot's tokens form
one contiguous range; each slot then runs two matmuls over its whole range (one Python iteration per slot
that received tokens, never one per token), and the weighted rows are summed back per token with a
single index_add_. This is the CPU realisation of a grouped GEMM.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def group_by_slot(slot_ids: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): `order` sorts the flat pairs by slot (stable); `counts[s]` pairs go to slot s."""
    flat = slot_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_slots)
    return order, counts


def grouped_swiglu_experts(
    rows: torch.Tensor,  # [num_rows, hidden], already sorted by slot
    counts: list[int],  # rows per slot, in slot order
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:  # [num_rows, hidden], unweighted expert outputs
    """Each slot's contiguous range of rows through that slot's SwiGLU MLP."""
    output = torch.empty_like(rows)
    intermediate = w2.shape[-1]
    start = 0
    for slot, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        gate_up = F.linear(rows[start:end], w13[slot])
        activated = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        output[start:end] = F.linear(activated, w2[slot])
        start = end
    return output


def fused_experts(
    hidden_states: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    slot_ids: torch.Tensor,  # [num_tokens, top_k] int64 slot of each pair in w13/w2
    compute_slots: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None,
) -> torch.Tensor:  # [num_tokens, hidden]
    """sum_k topk_weights[t, k] * expert_{slot_ids[t, k]}(hidden_states[t]) (the grouped path). `compute_slots`
    (rows sorted by slot, counts) -> unweighted outputs replaces the float SwiGLU (W8A8 experts pass theirs)."""
    num_tokens, top_k = slot_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(hidden_states)
    order, counts = group_by_slot(slot_ids, w13.shape[0])
    token_of_pair = order // top_k
    rows = hidden_states.index_select(0, token_of_pair)
    expert_out = (grouped_swiglu_experts(rows, counts.tolist(), w13, w2) if compute_slots is None
                  else compute_slots(rows, counts.tolist()))
    weights = topk_weights.reshape(-1).index_select(0, order).to(expert_out.dtype)
    output = torch.zeros_like(hidden_states)
    output.index_add_(0, token_of_pair, expert_out * weights[:, None])
    return output


def reference_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """The dense oracle: every expert on every token, then a masked weighted sum. Slow, obviously right."""
    num_slots = w13.shape[0]
    intermediate = w2.shape[-1]
    output = torch.zeros_like(hidden_states)
    for slot in range(num_slots):
        gate_up = hidden_states @ w13[slot].T
        expert_out = (F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]) @ w2[slot].T
        weight = (topk_weights * (slot_ids == slot)).sum(dim=-1, keepdim=True).to(expert_out.dtype)
        output += weight * expert_out
    return output
