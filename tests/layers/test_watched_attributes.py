"""layers/watched_attributes.py: the layers native plans read count replaced weights and methods.

Assigning, deleting or registering a watched name on a CustomOp, LinearBase or VocabParallelEmbedding advances the
process-wide epoch; other names (per-call memos, sizes) and other modules leave it; a value changed in place
needs no notice. tests/models/test_native_decode_stack.py checks what the decode stack does with it.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedserve.layers.embedding import VocabParallelEmbedding
from pagedserve.layers.linear import ReplicatedLinear
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.layers.watched_attributes import WATCHED_ATTRIBUTES, watched_attributes_epoch


def _moves(change) -> int:
    before = watched_attributes_epoch()
    change()
    return watched_attributes_epoch() - before


def test_plan_attribute_names_are_watched() -> None:
    from pagedserve.models import native_decode_stack

    assert set(native_decode_stack._SOURCE_ATTRIBUTES) <= WATCHED_ATTRIBUTES


@pytest.mark.parametrize("make", [
    lambda: RMSNorm(8),
    lambda: ReplicatedLinear(8, 4, bias=True, params_dtype=torch.float32),
    lambda: VocabParallelEmbedding(16, 8, params_dtype=torch.float32),
])
def test_replacing_a_weight_advances_the_epoch(make) -> None:
    module = make()
    assert _moves(lambda: setattr(module, "weight", nn.Parameter(torch.ones_like(module.weight)))) >= 1
    assert _moves(lambda: module.register_parameter("weight", nn.Parameter(torch.zeros_like(module.weight)))) >= 1
    assert _moves(lambda: delattr(module, "weight")) >= 1
    # In place: the plan holds this very tensor, so nothing needs counting.
    module.register_parameter("weight", nn.Parameter(torch.ones(4, 8)))
    assert _moves(lambda: module.weight.data.mul_(2)) == 0
    assert _moves(lambda: setattr(module, "not_watched", 3)) == 0


def test_linear_methods_packed_weights_and_buffers_are_watched() -> None:
    linear = ReplicatedLinear(8, 4, bias=False, params_dtype=torch.float32)
    assert _moves(lambda: setattr(linear, "linear_method", linear.linear_method)) >= 1
    assert _moves(lambda: setattr(linear, "packed_weight", torch.zeros(3))) >= 1
    assert _moves(lambda: setattr(linear, "bias", None)) >= 1  # a parameter slot: setattr registers it too
    rotary = RotaryEmbedding(8, 16, torch.zeros(16, 4))
    assert _moves(lambda: rotary.register_buffer("cos_sin_cache", torch.zeros(16, 8), persistent=False)) >= 1
    assert _moves(lambda: setattr(rotary, "cos_sin_cache", torch.ones(16, 8))) >= 1
    # The rotary module's per-forward memos and other modules' weights are not counted.
    assert _moves(lambda: setattr(rotary, "_memo", None)) == 0
    assert _moves(lambda: setattr(nn.Linear(2, 2), "weight", nn.Parameter(torch.ones(2, 2)))) == 0
