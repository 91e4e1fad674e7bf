"""The model runner's forward seam for pipeline parallelism.

`build_stage_forward(model, ...)` returns the callable the model runner runs each step as
`forward(input_ids, positions) -> hidden states | None`:

- one stage (no pipeline parallelism): the model itself, untouched;
- a stage after the first first receives the previous stage's IntermediateTensors (blocking);
- a stage before the last sends its IntermediateTensors on (without waiting) and returns None: it does
  not compute logits or sample. Its persistent batch learns the sampled tokens from the next step's
  cached-request deltas (CachedRequestData.new_token_ids), never from a broadcast by the last stage, so
  a stage is free to run the next micro-batch while later stages finish this one.

Every stage builds the same step inputs (input ids, positions, attention metadata) from identical
persistent batches; only the first stage reads the input ids (embedding lookup).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from pagedserve.config.model import ModelConfig
from pagedserve.distributed.parallel_state import get_pp_group
from pagedserve.distributed.pipeline_comm import IntermediateTensors, PipelineCommunicator

StageForward = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]


class PipelineStageForward:
    """One pipeline stage's step forward: receive, run this stage's layers, send or return."""

    def __init__(self, model: nn.Module, communicator: PipelineCommunicator) -> None:
        self.model = model
        self.communicator = communicator

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        intermediate_tensors = None
        if not self.communicator.is_first_stage:
            intermediate_tensors = self.communicator.recv(int(input_ids.shape[0]))
        output = self.model(input_ids, positions, intermediate_tensors)
        if self.communicator.is_last_stage:
            return output
        assert isinstance(output, IntermediateTensors), type(output)
        self.communicator.send(output)
        return None


def build_stage_forward(model: nn.Module, model_config: ModelConfig, device: torch.device) -> StageForward:
    """The model itself on a single stage, else a PipelineStageForward over this process's PP group."""
    group = get_pp_group()
    if group.world_size == 1:
        return model
    hidden_size = int(model_config.hf_config.hidden_size)
    return PipelineStageForward(model, PipelineCommunicator(hidden_size, model_config.dtype, device, group))


def is_last_pipeline_stage() -> bool:
    """Whether this process samples (always, without pipeline parallelism)."""
    return get_pp_group().is_last_rank
