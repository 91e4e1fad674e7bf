"""Frozen configuration dataclasses, one module per concern, aggregated in EngineConfig."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.config.cache import CacheConfig
    from pagedserve.config.engine import EngineConfig
    from pagedserve.config.model import ModelConfig
    from pagedserve.config.scheduler import SchedulerConfig

__all__ = ["CacheConfig", "EngineConfig", "ModelConfig", "SchedulerConfig"]

# Imported on first use: the light modules (config.load, used by the command-line parser) do not pull in torch
# through this package.
_LAZY_NAMES = {
    "CacheConfig": "pagedserve.config.cache",
    "EngineConfig": "pagedserve.config.engine",
    "ModelConfig": "pagedserve.config.model",
    "SchedulerConfig": "pagedserve.config.scheduler",
}


def __getattr__(name: str) -> Any:
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedserve.config' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_NAMES))
