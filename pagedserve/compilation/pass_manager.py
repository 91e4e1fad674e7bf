"""FusionPassManager: apply the enabled fusion passes, in a fixed order, to an FX GraphModule.

Order: norm(+quant) first (it consumes the residual adds), then q/k norm + RoPE, then muls_add last
(its `x * scale + y` must not steal a multiply-add inside a norm pattern). Use it as the graph pass of a
torch.compile backend:

    manager = build_fusion_pass_manager(CompilationConfig())
    def backend(graph_module, example_inputs):
        return compile_fx(manager(graph_module), example_inputs)   # or graph_module.forward in eager
"""
from __future__ import annotations

import logging

from torch import fx

from pagedserve.compilation.add_rms_norm_fusion import AddRMSNormQuantFusionPass
from pagedserve.compilation.fusion_pass import FusionPass
from pagedserve.compilation.muls_add_fusion import MulsAddFusionPass
from pagedserve.compilation.qk_norm_rope_fusion import QKNormRopeFusionPass
from pagedserve.config.compilation import CompilationConfig

logger = logging.getLogger(__name__)


class FusionPassManager:
    """Callable: GraphModule -> the same GraphModule, rewritten; counts replacements per pass."""

    def __init__(self, passes: list[FusionPass]) -> None:
        self.passes = passes
        # Replacements made by each pass over every graph this manager has seen.
        self.num_replacements: dict[str, int] = {fusion_pass.name: 0 for fusion_pass in passes}

    def __call__(self, graph_module: fx.GraphModule) -> fx.GraphModule:
        for fusion_pass in self.passes:
            num_replaced = fusion_pass(graph_module)
            self.num_replacements[fusion_pass.name] += num_replaced
            if num_replaced:
                logger.debug("%s: %d replacement(s)", fusion_pass.name, num_replaced)
        return graph_module


def build_fusion_pass_manager(config: CompilationConfig) -> FusionPassManager:
    """The manager running the passes `config` enables (none enabled: graphs come back unchanged)."""
    passes: list[FusionPass] = []
    if config.fuse_norm_quant:
        passes.append(AddRMSNormQuantFusionPass())
    if config.fuse_qknorm_rope:
        passes.append(QKNormRopeFusionPass())
    if config.fuse_muls_add:
        passes.append(MulsAddFusionPass())
    return FusionPassManager(passes)


__all__ = ["FusionPassManager", "build_fusion_pass_manager"]
