"""Frozen configuration dataclasses, one module per concern, aggregated in EngineConfig."""
from pagedserve.config.cache import CacheConfig
from pagedserve.config.engine import EngineConfig
from pagedserve.config.model import ModelConfig
from pagedserve.config.scheduler import SchedulerConfig

__all__ = ["CacheConfig", "EngineConfig", "ModelConfig", "SchedulerConfig"]
