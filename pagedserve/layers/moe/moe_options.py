"""Build-time MoE options: what the engine config says about expert placement and overlap.

Models are built as `model_class(hf_config, dtype)`; the MoE layers read these options while they are
constructed, so the model interface stays unchanged. The worker enters `use_moe_options(...)` around
model loading; tests construct layers with explicit arguments instead.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator


@dataclass(frozen=True)
class MoeOptions:
    # Partition the experts over the expert-parallel group (DP x TP) instead of replicating them.
    enable_expert_parallel: bool = False
    # Extra physical expert slots (EPLB replicas of hot experts); 0 without EPLB.
    num_redundant_experts: int = 0
    # Run the shared experts on a second stream (CUDA); a no-op on the CPU.
    multistream_overlap_shared_expert: bool = False


_current = MoeOptions()


def current_moe_options() -> MoeOptions:
    return _current


@contextmanager
def use_moe_options(options: MoeOptions) -> Iterator[MoeOptions]:
    global _current
    previous, _current = _current, options
    try:
        yield options
    finally:
        _current = previous


def moe_options_from_engine_config(config: Any) -> MoeOptions:
    """The options an EngineConfig implies (fields missing from older configs read as off)."""
    parallel_config = getattr(config, "parallel_config", None)
    eplb_config = getattr(config, "eplb_config", None)
    return MoeOptions(
        enable_expert_parallel=bool(getattr(parallel_config, "enable_expert_parallel", False)),
        num_redundant_experts=int(eplb_config.num_redundant_experts) if eplb_config is not None
        and eplb_config.enable else 0,
        multistream_overlap_shared_expert=bool(getattr(config, "multistream_overlap_shared_expert", False)),
    )
