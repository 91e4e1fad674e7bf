"""Worker: one rank's device, model, KV cache and model runner."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagedserve.config.engine import EngineConfig
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.model_loader import load_model
from pagedserve.model_loader.model_source import open_model_source
from pagedserve.platforms import current_platform
from pagedserve.worker.kv_cache_allocation import (allocate_kv_caches, determine_num_kv_blocks,
                                                   kv_bytes_per_block)
from pagedserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeInfo:
    """Values derived at start (never written back into the config)."""

    num_kv_blocks: int
    kv_cache_bytes: int
    attention_backend: str


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.platform = current_platform()
        self.device = self.platform.device
        if config.num_cpu_threads is not None:
            torch.set_num_threads(config.num_cpu_threads)
        torch.manual_seed(config.model_config.seed)
        model_config = config.model_config
        source = open_model_source(model_config.model)
        model = load_model(model_config, self.device, weights=source.weights(model_config.dtype))
        self.model_runner = ModelRunner(config, model, self.device)
        cache_config = config.cache_config
        bytes_per_block = kv_bytes_per_block(model, cache_config.block_size, model_config.dtype)
        num_blocks = determine_num_kv_blocks(cache_config, bytes_per_block,
                                             self.platform.available_memory_bytes(),
                                             model_config.max_model_len,
                                             config.scheduler_config.max_num_seqs)
        kv_caches = allocate_kv_caches(model, num_blocks, cache_config.block_size, model_config.dtype,
                                       self.platform)
        self.model_runner.bind_kv_caches(kv_caches)
        self.runtime_info = RuntimeInfo(num_kv_blocks=num_blocks, kv_cache_bytes=num_blocks * bytes_per_block,
                                        attention_backend=config.attention_backend)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB), max %d concurrent tokens",
                    num_blocks, cache_config.block_size, num_blocks * bytes_per_block / 2**20,
                    (num_blocks - 1) * cache_config.block_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)
