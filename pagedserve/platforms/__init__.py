"""current_platform(): CUDA when a GPU is usable and not disabled, else the CPU.

PAGEDSERVE_DEVICE=cpu|cuda forces a choice.
"""
from __future__ import annotations

import functools
import os

import torch

from pagedserve.platforms.interface import Platform


@functools.cache
def current_platform() -> Platform:
    forced = os.environ.get("PAGEDSERVE_DEVICE", "").lower()
    if forced not in ("", "cpu", "cuda"):
        raise ValueError(f"PAGEDSERVE_DEVICE={forced!r} must be 'cpu' or 'cuda'")
    if forced == "cuda" or (forced == "" and torch.cuda.is_available()):
        from pagedserve.platforms.cuda import CudaPlatform

        return CudaPlatform()
    from pagedserve.platforms.cpu import CpuPlatform

    return CpuPlatform()


__all__ = ["Platform", "current_platform"]
