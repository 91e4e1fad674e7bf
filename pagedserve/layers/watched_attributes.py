"""A process-wide count of replaced layer weights and methods: what native plans compare before each step.

A native fast path (models/native_decode_stack.py) holds the tensors and linear methods the layers had when its
plan was made. Code may replace them later (`restore_plain_layout`, a reloaded parameter, a swapped linear method),
and the plan must then be made again. Comparing every attribute the plan read (~550 for SmolLM2-135M) cost ~170 us
of each batch-1 decode step on the Zen 4 VM: the step's weight stream evicts those Python objects from every cache,
so each comparison is a trip to memory. The layers that plans read (CustomOp, LinearBase, VocabParallelEmbedding,
Attention) instead count assignments to the attribute names plans read; a plan compares one integer and compares its
attributes only when the count moved.

Counted: assignment and deletion of a watched name through the module (`layer.weight = ...`, setattr, delattr),
and register_parameter / register_buffer of one. Not counted: writes straight into a module's `_parameters`,
`_buffers` or `__dict__`, which bypass nn.Module's API. A change of a tensor's values needs no notice: the plan
holds the tensor itself.
"""
from __future__ import annotations

from typing import Any

import torch

# The attribute names native plans read from layers.
WATCHED_ATTRIBUTES = frozenset(("weight", "bias", "packed_weight", "cos_sin_cache", "linear_method", "kv_cache",
                                "weight_scale_row", "input_scale", "gguf_parts"))

_epoch = 0


def watched_attributes_epoch() -> int:
    """How many times a watched attribute of a watching layer was assigned, deleted or registered so far."""
    return _epoch


def _advance() -> None:
    global _epoch
    _epoch += 1


class WatchedAttributes:
    """Mixin for nn.Module subclasses (listed before nn.Module): changing a watched attribute advances the epoch."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in WATCHED_ATTRIBUTES:
            _advance()
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name in WATCHED_ATTRIBUTES:
            _advance()
        super().__delattr__(name)

    def register_parameter(self, name: str, param: torch.nn.Parameter | None) -> None:
        if name in WATCHED_ATTRIBUTES:
            _advance()
        super().register_parameter(name, param)  # type: ignore[misc]

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        if name in WATCHED_ATTRIBUTES:
            _advance()
        super().register_buffer(name, tensor, persistent)  # type: ignore[misc]


__all__ = ["WATCHED_ATTRIBUTES", "WatchedAttributes", "watched_attributes_epoch"]
