"""TargetLayerCapture: the residual stream at chosen decoder layers of the target, kept from its last forward
(EAGLE-3 reads the inputs of three layers, DFlash and DSpark the outputs of theirs, instead of the final hidden
state).

Hooks on the target's decoder layers, which are called as layer(positions, hidden_states, residual) and return
(hidden_states, residual): a layer's input is hidden_states + residual (hidden_states alone for the first layer,
before any residual), its output the returned pair's sum; output -1 is the embedding's. The hooks run only in an
eager forward: the runner does not compile or replace the target's forward while they are on.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class TargetLayerCapture:
    def __init__(self, target: nn.Module, layer_ids: tuple[int, ...], *, outputs: bool = False) -> None:
        """`outputs`: capture what the layers return (DFlash / DSpark's target_layer_ids) instead of what enters
        them (EAGLE-3's)."""
        layers = target.model.layers
        self.layer_ids = layer_ids
        self._captured: dict[int, torch.Tensor] = {}
        self._handles = []
        for index in set(layer_ids):
            if not outputs:
                self._handles.append(layers[index].register_forward_pre_hook(self._input_hook(index)))
            elif index == -1:
                self._handles.append(target.model.embed_tokens.register_forward_hook(self._embedding_hook(index)))
            else:
                self._handles.append(layers[index].register_forward_hook(self._output_hook(index)))

    def _input_hook(self, index: int):  # type: ignore[no-untyped-def]
        def capture(module: nn.Module, args: tuple[Any, ...]) -> None:
            _, hidden_states, residual = args
            self._captured[index] = hidden_states if residual is None else hidden_states + residual

        return capture

    def _output_hook(self, index: int):  # type: ignore[no-untyped-def]
        def capture(module: nn.Module, args: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
            hidden_states, residual = output
            self._captured[index] = hidden_states + residual

        return capture

    def _embedding_hook(self, index: int):  # type: ignore[no-untyped-def]
        def capture(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            self._captured[index] = output

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
