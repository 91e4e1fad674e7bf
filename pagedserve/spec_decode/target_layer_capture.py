"""TargetLayerCapture: the residual stream entering chosen decoder layers of the target, kept from its last
forward (EAGLE-3 reads three of them instead of the final hidden state).

Pre-forward hooks on the target's decoder layers (called as layer(positions, hidden_states, residual)): the
layer's input is hidden_states + residual, or hidden_states for the first layer (no residual yet). The hooks
run only in an eager forward: the runner does not compile or replace the target's forward while they are on.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class TargetLayerCapture:
    def __init__(self, target: nn.Module, layer_ids: tuple[int, ...]) -> None:
        layers = target.model.layers
        self.layer_ids = layer_ids
        self._captured: dict[int, torch.Tensor] = {}
        self._handles = [layers[index].register_forward_pre_hook(self._hook(index)) for index in set(layer_ids)]

    def _hook(self, index: int):  # type: ignore[no-untyped-def]
        def capture(module: nn.Module, args: tuple[Any, ...]) -> None:
            _, hidden_states, residual = args
            self._captured[index] = hidden_states if residual is None else hidden_states + residual

        return capture

    def hidden_states(self) -> torch.Tensor:
        """[num tokens of the last forward, len(layer_ids) * hidden], the layers in `layer_ids` order."""
        missing = [index for index in self.layer_ids if index not in self._captured]
        if missing:
            raise RuntimeError(f"target layers {missing} did not run in the last forward (a compiled or native "
                               f"forward skips the capture hooks)")
        return torch.cat([self._captured[index] for index in self.layer_ids], dim=-1)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._captured.clear()


__all__ = ["TargetLayerCapture"]
