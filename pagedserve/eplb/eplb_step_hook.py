"""EplbStepHook: the worker's periodic EPLB driver (one `after_step()` call per executed step).

Each step: the load recorder snapshots the MoE layers' per-expert counters. Every `step_interval` steps:
the window's loads are summed over the EP group (so every rank plans from the same numbers), the policy
computes each layer's new placement, the weights move (pagedserve.eplb.rebalancer) and the per-layer
imbalance (max/mean tokens per rank over the window) before and after is kept for the engine's stats.
A layer whose new placement would be invalid keeps its current one.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.config.eplb import EplbConfig
from pagedserve.eplb.load_recorder import ExpertLoadRecorder
from pagedserve.eplb.placement_policy import get_policy
from pagedserve.eplb.rebalancer import move_expert_weights
from pagedserve.layers.moe.expert_placement import imbalance
from pagedserve.layers.moe.fused_moe import FusedMoE

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebalanceReport:
    step: int
    imbalance_before: list[float]  # per MoE layer, max/mean tokens per rank over the window
    imbalance_after: list[float]


class EplbStepHook:
    def __init__(self, model: nn.Module, config: EplbConfig) -> None:
        self.config = config
        self.layers = [module for module in model.modules() if isinstance(module, FusedMoE)]
        self.recorder = ExpertLoadRecorder(self.layers, config.window_size)
        self.policy = get_policy(config.policy)
        self.num_steps = 0
        self.reports: list[RebalanceReport] = []

    @torch.no_grad()
    def after_step(self) -> RebalanceReport | None:
        self.recorder.record_step()
        self.num_steps += 1
        if self.num_steps % self.config.step_interval != 0:
            return None
        return self.rebalance()

    @torch.no_grad()
    def rebalance(self) -> RebalanceReport:
        loads = self.recorder.window_loads()  # [steps, layers, experts]
        first = self.layers[0]
        first.ep_group.all_reduce(loads)  # every EP rank routes its own tokens: sum their counts
        before, after = [], []
        for index, layer in enumerate(self.layers):
            layer_loads = loads[:, index]
            total = layer_loads.sum(dim=0)
            current = layer.physical_to_logical
            try:
                placement = torch.from_numpy(self.policy.place(
                    layer_loads.numpy(), layer.ep_size, layer.num_local_slots, current.numpy()))
                layer_before = imbalance(total, current, layer.ep_size)
                move_expert_weights(layer, placement)
            except ValueError as error:
                logger.warning("EPLB: %s keeps its placement: %s", layer.prefix, error)
                placement = current
                layer_before = imbalance(total, current, layer.ep_size)
            before.append(layer_before)
            after.append(imbalance(total, placement, layer.ep_size))
        report = RebalanceReport(step=self.num_steps, imbalance_before=before, imbalance_after=after)
        self.reports.append(report)
        logger.info("EPLB rebalance at step %d: imbalance %s -> %s", self.num_steps,
                    [round(x, 3) for x in before], [round(x, 3) for x in after])
        return report
