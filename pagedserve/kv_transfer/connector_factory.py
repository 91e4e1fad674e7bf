"""Builds a kv_transfer_config's connector: its scheduler side (engine core) and its worker side (worker).

The registry is a plain dict of connector name -> (scheduler side, worker side) builders, imported lazily.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedserve.config.kv_transfer import KVTransferConfig
from pagedserve.kv_transfer.connector_base import KVConnectorScheduler, KVConnectorWorker

if TYPE_CHECKING:
    import torch
    from torch import nn

    from pagedserve.config.engine import EngineConfig


def create_scheduler_connector(config: KVTransferConfig, block_size: int, port: int,
                               engine_signature: dict[str, Any] | None = None) -> KVConnectorScheduler:
    """The scheduler side; `port`: where this engine's worker serves its blocks (its producer part's);
    `engine_signature`: kv_engine_signature(engine config) (a pool connector names its blocks with it)."""
    if config.kv_connector == "MultiConnector":
        from pagedserve.kv_transfer.multi_connector import MultiConnectorScheduler

        return MultiConnectorScheduler([create_scheduler_connector(part, block_size, port, engine_signature)
                                        for part in config.connector_configs])
    if config.kv_connector == "PoolConnector":
        from pagedserve.kv_transfer.pool_connector_scheduler import PoolConnectorScheduler

        if engine_signature is None:
            raise ValueError("a PoolConnector's scheduler side needs the engine signature (kv_engine_signature)")
        return PoolConnectorScheduler(config, block_size, engine_signature)
    from pagedserve.kv_transfer.pull_connector_scheduler import PullConnectorScheduler

    return PullConnectorScheduler(config, block_size, config.extra("host"), port)


def create_worker_connector(config: KVTransferConfig, engine_signature: dict[str, Any]) -> KVConnectorWorker:
    """The worker side; `engine_signature`: what peers must share (block size, dtypes, model)."""
    if config.kv_connector == "MultiConnector":
        from pagedserve.kv_transfer.multi_connector import MultiConnectorWorker

        return MultiConnectorWorker([create_worker_connector(part, engine_signature)
                                     for part in config.connector_configs])
    if config.kv_connector == "PoolConnector":
        from pagedserve.kv_transfer.pool_connector_worker import PoolConnectorWorker

        return PoolConnectorWorker(config, engine_signature)
    from pagedserve.kv_transfer.pull_connector_worker import PullConnectorWorker

    # PD peers may load one model from different paths: the model's name is no part of their handshake.
    return PullConnectorWorker(config, {key: value for key, value in engine_signature.items()
                                        if key != "model_name"})


def kv_engine_signature(config: EngineConfig) -> dict[str, Any]:
    """What makes this engine's KV blocks what they are: block size, dtypes, the model's shape and its name (as
    given: a pool keeps the blocks of different weights of one architecture apart by it)."""
    model_config, cache_config = config.model_config, config.cache_config
    hf_config = model_config.hf_config
    return {
        "block_size": cache_config.block_size,
        "dtype": str(model_config.dtype),
        "kv_cache_dtype": cache_config.kv_cache_dtype,
        "model": f"{(getattr(hf_config, 'architectures', None) or ['?'])[0]} "
                 f"layers={getattr(hf_config, 'num_hidden_layers', '?')} "
                 f"hidden_size={getattr(hf_config, 'hidden_size', '?')} "
                 f"vocab_size={getattr(hf_config, 'vocab_size', '?')}",
        "model_name": model_config.model,
    }


def connect_worker_kv_caches(config: EngineConfig, kv_cache_modules: nn.Module, kv_caches: list[torch.Tensor],
                             num_blocks: int) -> KVConnectorWorker:
    """The worker side of config.kv_transfer_config with the worker's caches registered (layer names from the
    modules, page layouts from the layers' specs); peers must share the signature built here."""
    from pagedserve.worker.kv_cache_allocation import attention_layers

    assert config.kv_transfer_config is not None
    model_config, cache_config = config.model_config, config.cache_config
    names = {id(module): name for name, module in kv_cache_modules.named_modules()}
    layers = attention_layers(kv_cache_modules)
    caches = {names[id(layer)]: cache for layer, cache in zip(layers, kv_caches, strict=True)}
    layouts = {names[id(layer)]: layer.kv_cache_spec().page_layout(cache_config.block_size, model_config.dtype,
                                                                    cache_config.kv_cache_dtype)
               for layer in layers}
    connector = create_worker_connector(config.kv_transfer_config, kv_engine_signature(config))
    connector.register_kv_caches(caches, layouts, num_blocks)
    return connector
