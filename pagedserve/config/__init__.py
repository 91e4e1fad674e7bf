"""Frozen configuration dataclasses, one module per concern, aggregated in EngineConfig."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.lazy_names import lazy_attributes

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


__getattr__, __dir__ = lazy_attributes("pagedserve.config", globals(), _LAZY_NAMES)
