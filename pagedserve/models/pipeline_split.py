"""Pipeline-parallel split of a decoder: which layers (and which ends of the model) one stage holds.

Layer split rule: every stage gets num_layers // num_stages consecutive layers, and the remainder
(num_layers % num_stages layers, one each) goes to the stages just before the last one (the last stage
is spared because it also runs the final norm, the LM head and the sampler; when the remainder is
large the first stage, which runs the cheap embedding lookup, is the last to get one). For example
5 layers over 2 stages: [3, 2]; 6 over 4: [1, 2, 2, 1]; 7 over 4: [2, 2, 2, 1]. This is the same
balance vLLM's default partition strikes.

Besides its layers, the first stage holds the word embedding and the last stage the final norm and the
LM head. With tied embeddings and more than one stage the last stage owns an LM head of its own, loaded
from the checkpoint's `model.embed_tokens.weight`. Layers a stage does not hold are
`PipelineMissingLayer` placeholders: no parameters, no KV cache, and the HF parameter names of the
layers that are held stay unchanged (`model.layers.N...` with the global N).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from pagedserve.distributed.parallel_state import get_pp_group

_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


def pipeline_layer_counts(num_layers: int, num_stages: int) -> list[int]:
    """Decoder layers per stage (see the module docstring for the rule)."""
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"pipeline_parallel_size={num_stages!r} must be an integer >= 1")
    if num_layers < num_stages:
        raise ValueError(f"pipeline_parallel_size={num_stages} exceeds the model's num_hidden_layers={num_layers}")
    counts = [num_layers // num_stages] * num_stages
    remainder = num_layers % num_stages
    for stage_index in range(num_stages - 1 - remainder, num_stages - 1):
        counts[stage_index] += 1
    return counts


def pipeline_layer_range(num_layers: int, stage_index: int, num_stages: int) -> tuple[int, int]:
    """The global layer indices [start, end) stage `stage_index` of `num_stages` holds."""
    counts = pipeline_layer_counts(num_layers, num_stages)
    if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
        raise ValueError(f"pipeline stage {stage_index!r} must be in [0, {num_stages - 1}]")
    start = sum(counts[:stage_index])
    return start, start + counts[stage_index]


@dataclass(frozen=True)
class PipelineStage:
    """One stage's share of a decoder of `num_layers` layers."""

    index: int
    num_stages: int
    start_layer: int
    end_layer: int

    @staticmethod
    def of(num_layers: int, index: int = 0, num_stages: int = 1) -> "PipelineStage":
        start, end = pipeline_layer_range(num_layers, index, num_stages)
        return PipelineStage(index=index, num_stages=num_stages, start_layer=start, end_layer=end)

    @staticmethod
    def current(num_layers: int) -> "PipelineStage":
        """This process's stage, from its PP group (stage 0 of 1 in a single-stage engine)."""
        group = get_pp_group()
        return PipelineStage.of(num_layers, group.rank, group.world_size)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def holds_layer(self, layer_index: int) -> bool:
        return self.start_layer <= layer_index < self.end_layer


class PipelineMissingLayer(nn.Module):
    """Stands in for a module another pipeline stage holds: no parameters, and never called."""

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("a module held by another pipeline stage was called on this stage")


def make_stage_layers(num_layers: int, stage: PipelineStage,
                      build_layer: Callable[[int], nn.Module]) -> nn.ModuleList:
    """A ModuleList of all `num_layers` positions: built layers for this stage's range, placeholders
    elsewhere (so `layers[N]` keeps the global index N and the HF names `...layers.N...`)."""
    return nn.ModuleList(build_layer(index) if stage.holds_layer(index) else PipelineMissingLayer()
                         for index in range(num_layers))


def stage_weights(weights: Iterable[tuple[str, object]], stage: PipelineStage, num_layers: int,
                  tie_word_embeddings: bool) -> Iterator[tuple[str, object]]:
    """The checkpoint tensors this stage loads, dropping the others unread (lazy slices stay unread).

    Decoder layers outside the stage's range, the embedding off the first stage, the final norm and LM
    head off the last stage are dropped. With tied embeddings the last stage (when it is not also the
    first) receives `model.embed_tokens.weight` as its `lm_head.weight`. Layer indices past the
    decoder (multi-token-prediction layers) pass through: the model's own loader decides about them.
    """
    if stage.num_stages == 1:
        yield from weights
        return
    for name, tensor in weights:
        layer = _LAYER_NAME.match(name)
        if layer is not None:
            layer_index = int(layer[1])
            if layer_index < num_layers and not stage.holds_layer(layer_index):
                continue
        elif name.startswith("model.embed_tokens."):
            if stage.is_first:
                yield name, tensor
            if stage.is_last and tie_word_embeddings:
                yield "lm_head." + name[len("model.embed_tokens."):], tensor
            continue
        elif name.startswith("lm_head."):
            # A tied checkpoint's own copy of the head (some carry one) is the embedding: taken from there.
            if stage.is_last and not tie_word_embeddings:
                yield name, tensor
            continue
        elif name.startswith("model.norm.") and not stage.is_last:
            continue
        yield name, tensor


__all__ = ["PipelineMissingLayer", "PipelineStage", "make_stage_layers", "pipeline_layer_counts",
           "pipeline_layer_range", "stage_weights"]
