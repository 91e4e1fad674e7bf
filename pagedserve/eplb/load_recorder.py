"""ExpertLoadRecorder: per-layer per-expert token counts, one row per step, over a sliding window.

The MoE layers count into rows of one [num_layers, num_experts] table the recorder binds to them (one
bincount-add per layer per forward); `record_step()` copies that table into a ring buffer of
`window_size` steps and zeroes it: one small copy per step, no per-layer work.
"""
from __future__ import annotations

import torch


class ExpertLoadRecorder:
    def __init__(self, moe_layers: list, window_size: int) -> None:
        if not moe_layers:
            raise ValueError("EPLB needs a model with MoE layers; this model has none")
        self.num_layers = len(moe_layers)
        self.num_experts = moe_layers[0].num_logical_experts
        self.window_size = window_size
        self.current = torch.zeros(self.num_layers, self.num_experts, dtype=torch.long)
        for index, layer in enumerate(moe_layers):
            layer.bind_expert_load(self.current[index])
        self.window = torch.zeros(window_size, self.num_layers, self.num_experts, dtype=torch.long)
        self.num_recorded = 0

    def record_step(self) -> None:
        self.window[self.num_recorded % self.window_size].copy_(self.current)
        self.current.zero_()
        self.num_recorded += 1

    def window_loads(self) -> torch.Tensor:
        """[steps, layers, experts] for the recorded steps of the window, oldest first."""
        count = min(self.num_recorded, self.window_size)
        if self.num_recorded <= self.window_size:
            return self.window[:count].clone()
        start = self.num_recorded % self.window_size
        return torch.cat([self.window[start:], self.window[:start]])
