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


def create_scheduler_connector(config: KVTransferConfig, block_size: int, ports: list[int],
                               engine_signature: dict[str, Any] | None = None) -> KVConnectorScheduler:
    """The scheduler side; `ports`: where this engine's workers serve their blocks (their producer part's), one
    per rank in rank order; `engine_signature`: kv_engine_signature(engine config) (a pool connector names its
    blocks with it)."""
    if config.kv_connector == "MultiConnector":
        from pagedserve.kv_transfer.multi_connector import MultiConnectorScheduler

        return MultiConnectorScheduler([create_scheduler_connector(part, block_size, ports, engine_signature)
                                        for part in config.connector_configs])
    if config.kv_connector == "PoolConnector":
        from pagedserve.kv_transfer.pool_connector_scheduler import PoolConnectorScheduler

        if engine_signature is None:
            raise ValueError("a PoolConnector's scheduler side needs the engine signature (kv_engine_signature)")
        return PoolConnectorScheduler(config, block_size, engine_signature)
    if config.extra("mode") == "push":
        from pagedserve.kv_transfer.push_connector_scheduler import PushConnectorScheduler

        return PushConnectorScheduler(config, block_size, config.extra("host"), ports)
    from pagedserve.kv_transfer.pull_connector_scheduler import PullConnectorScheduler

    return PullConnectorScheduler(config, block_size, config.extra("host"), ports)


def create_worker_connector(config: KVTransferConfig, engine_signature: dict[str, Any],
                            placement: dict[str, Any] | None = None) -> KVConnectorWorker:
    """The worker side; `engine_signature`: kv_engine_signature (block size, dtypes, model); `placement`:
    kv_placement, this rank's place in its engine (PD peers map their ranks with it)."""
    if config.kv_connector == "MultiConnector":
        from pagedserve.kv_transfer.multi_connector import MultiConnectorWorker

        return MultiConnectorWorker([create_worker_connector(part, engine_signature, placement)
                                     for part in config.connector_configs])
    if config.kv_connector == "PoolConnector":
        from pagedserve.kv_transfer.pool_connector_worker import PoolConnectorWorker

        # The scheduler side names blocks by the same signature (EngineCore): no per-rank keys in it.
        return PoolConnectorWorker(config, engine_signature)
    from pagedserve.kv_transfer.pull_connector_worker import PullConnectorWorker

    # PD peers may load one model from different paths: the model's name is no part of their handshake.
    signature = (placement or {}) | {key: value for key, value in engine_signature.items() if key != "model_name"}
    if config.extra("mode") == "push":
        from pagedserve.kv_transfer.push_connector_worker import PushConnectorWorker

        return PushConnectorWorker(config, signature)
    return PullConnectorWorker(config, signature)


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
                             num_blocks: int, target_model: nn.Module | None = None,
                             draft_model: nn.Module | None = None) -> KVConnectorWorker:
    """The worker side of config.kv_transfer_config with the worker's caches registered (layer names from the
    modules, page layouts from the layers' specs); peers must share the signature built here.

    `kv_caches` holds one cache per attention layer of `kv_cache_modules` (`target_model`, then a speculative
    `draft_model`; None: every layer is the target's). Which drafter pages travel (config/kv_transfer.py
    DRAFTER_KV_TRAVELS_METHODS):
    - a draft model ('draft_model') recomputes its own KV over the whole prompt at a request's first draft
      (spec_decode/draft_model_proposer.py): its pages are not registered, and engines with and without one pair up;
    - a hidden-state drafter ('eagle', 'eagle3', 'mtp') computes its KV at each prompt position from the target's
      hidden state there, which only the engine that computed the prompt has: its pages are registered too, named
      `drafter.<name in the drafter>`, so a consumer with such a drafter pulls them from a producer running the
      same speculative_config (a producer without it fails the handshake naming the drafter's layer)."""
    from pagedserve.config.kv_transfer import DRAFTER_KV_TRAVELS_METHODS
    from pagedserve.worker.kv_cache_allocation import attention_layers

    assert config.kv_transfer_config is not None
    model_config, cache_config = config.model_config, config.cache_config
    names = {id(module): name for name, module in kv_cache_modules.named_modules()}
    all_layers = attention_layers(kv_cache_modules)
    target_layers = attention_layers(target_model) if target_model is not None else all_layers
    transferred = {id(layer) for layer in target_layers}
    total_heads = {id(layer): _total_kv_heads(model_config.hf_config) for layer in target_layers}
    if draft_model is not None and config.speculative_config.method in DRAFTER_KV_TRAVELS_METHODS:
        drafter_names = {id(module): name for name, module in draft_model.named_modules()}
        for layer in attention_layers(draft_model):
            if id(layer) in transferred:
                continue  # a target layer the drafter reaches (keeps the target's name)
            transferred.add(id(layer))
            names[id(layer)] = f"drafter.{drafter_names[id(layer)]}"
            total_heads[id(layer)] = _total_kv_heads(getattr(draft_model, "config", None) or model_config.hf_config)
    pairs = [(layer, cache) for layer, cache in zip(all_layers, kv_caches, strict=True) if id(layer) in transferred]
    layers = [layer for layer, _ in pairs]
    caches = {names[id(layer)]: cache for layer, cache in pairs}
    layouts = {names[id(layer)]: layer.kv_cache_spec().page_layout(cache_config.block_size, model_config.dtype,
                                                                    cache_config.kv_cache_dtype)
               for layer in layers}
    connector = create_worker_connector(config.kv_transfer_config, kv_engine_signature(config),
                                        kv_placement(layers, [names[id(layer)] for layer in layers],
                                                     [total_heads[id(layer)] for layer in layers]))
    connector.register_kv_caches(caches, layouts, num_blocks)
    return connector


def _total_kv_heads(hf_config: Any) -> int:
    return int(getattr(hf_config, "num_key_value_heads", None) or getattr(hf_config, "num_attention_heads", 0))


def kv_placement(layers: list[nn.Module], layer_names: list[str], total_heads: list[int]) -> dict[str, Any]:
    """This rank's place in its engine (tp / pp rank and size) and, per dense K/V layer, the KV heads it holds
    ([first head, heads, total heads]; kv_pull_plan.py maps them onto a peer's); `total_heads`: each layer's model's
    num_key_value_heads. QKVParallelLinear's split: heads in equal intervals over the TP ranks, or, with fewer KV
    heads than ranks, head r // (tp / heads) on rank r; a layer not split over TP holds every head on every rank."""
    from pagedserve.distributed.parallel_state import get_pp_group, get_tp_group

    tp_group, pp_group = get_tp_group(), get_pp_group()
    tp_rank, tp_size = tp_group.rank, tp_group.world_size
    kv_heads: dict[str, list[int] | None] = {}
    for layer, name, total in zip(layers, layer_names, total_heads, strict=True):
        spec = layer.kv_cache_spec()
        if spec.latent_rank or spec.leading_shape != (2,) or len(spec.per_token_shape) != 2:
            kv_heads[name] = None  # MLA latents (and other single-row caches) are whole on every TP rank
            continue
        num_heads = spec.per_token_shape[0]
        if num_heads == total:
            # Every head on this rank: one rank, or a layer not split over TP (a drafter each rank runs whole).
            kv_heads[name] = [0, total, total]
            continue
        if num_heads != (1 if tp_size >= total else total // tp_size):
            raise ValueError(f"{name}: {num_heads} KV heads on each of {tp_size} TP ranks is not the split of the "
                             f"model's num_key_value_heads={total}; the KV connector cannot map its heads")
        first = tp_rank // (tp_size // total) if tp_size >= total else tp_rank * num_heads
        kv_heads[name] = [first, num_heads, total]
    return {"tp_rank": tp_rank, "tp_size": tp_size, "pp_rank": pp_group.rank, "pp_size": pp_group.world_size,
            "kv_heads": kv_heads}
