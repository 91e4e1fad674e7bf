"""SparseKVOffload: sparse KV offload for one worker (config/sparse_kv_offload.py).

At start it takes the place of the plain KV allocation for the model's DSA layers: each layer's `kv_cache` is its
region of the tier (OffloadTier: latent rows, a memory-mapped file), with the lightning indexer's keys (the layer's
extra page components) in a resident buffer of their own under the same block ids. The layers' existing paths then
write every new latent row through to the tier, and prefill tokens read their selected rows from it; decodes read
theirs through the layer's LayerResidentBuffers (SparseMLAAttention.decode_row_gather).

The model runner calls two seams per step: `free_requests` with the finished and preempted ids (their resident
buffers go), and `begin_step` with the step's request order (the rows the decode gather serves). The tier is
addressed by the engine's block ids, so freeing a request's blocks (finish, abort, preemption) frees its tier rows
as it frees its resident-cache pages. The tier's file is unlinked once mapped (offload_tier.py).

At start the plan is checked against the machine: the resident part (index keys, plus every request's buffers at
max_num_seqs) must fit in available memory, and the tier in the tier directory's free disk space (a write to a
sparse file on a full disk would kill the process with SIGBUS); each refusal names the knobs and both numbers.
"""
from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import torch
from torch import nn

from pagedserve.attention.kv_cache_spec import PRIMARY_COMPONENT
from pagedserve.attention.kv_page_layout import (
    KVCacheComponent,
    KVPageLayout,
    attach_kv_cache_components,
    kv_cache_components,
)
from pagedserve.config.sparse_kv_offload import SparseKVOffloadConfig
from pagedserve.core.sparse_kv_offload_stats import SparseKVOffloadStats
from pagedserve.layers.sparse_mla_attention import SparseMLAAttention
from pagedserve.platforms.interface import Platform
from pagedserve.sparse_kv_offload.layer_resident_buffers import LayerResidentBuffers, StepRequests
from pagedserve.sparse_kv_offload.offload_tier import OffloadTier, free_disk_bytes
from pagedserve.worker.kv_cache_allocation import attention_layers

logger = logging.getLogger(__name__)


def check_offload_fits(config: SparseKVOffloadConfig, *, tier_bytes: int, resident_bytes: int,
                       available_bytes: int, max_num_seqs: int) -> None:
    """ValueError when the resident part exceeds available memory or the tier the directory's free disk space."""
    if resident_bytes > available_bytes:
        raise ValueError(f"sparse_kv_offload: the resident index keys and buffers (num_resident_blocks="
                         f"{config.num_resident_blocks} per request and layer, max_num_seqs={max_num_seqs}) need "
                         f"{resident_bytes / 2**20:.1f} MiB, more than the {available_bytes / 2**20:.1f} MiB "
                         f"available: lower num_resident_blocks, max_num_seqs or the KV cache size")
    free_bytes = free_disk_bytes(config.tier_directory)
    if tier_bytes > free_bytes:
        raise ValueError(f"sparse_kv_offload: the tier needs {tier_bytes / 2**20:.1f} MiB but tier_directory="
                         f"{config.tier_directory!r} has {free_bytes / 2**20:.1f} MiB free: give a directory "
                         f"with more space, or lower kv_cache_memory / num_kv_blocks")


class SparseKVOffload:
    def __init__(self, config: SparseKVOffloadConfig, modules: nn.Module, num_blocks: int, block_size: int,
                 dtype: torch.dtype, platform: Platform, max_num_seqs: int) -> None:
        layers = attention_layers(modules)
        for layer in layers:
            if not isinstance(layer, SparseMLAAttention):
                raise ValueError(f"sparse_kv_offload offloads DeepSeek sparse-attention layers only; "
                                 f"{getattr(layer, 'layer_name', type(layer).__name__)} is a "
                                 f"{type(layer).__name__}: drop sparse_kv_offload")
        self.layers = layers
        specs = [layer.kv_cache_spec() for layer in layers]
        element_size = torch.empty((), dtype=dtype).element_size()
        tier_bytes = sum(math.prod(spec.tensor_shape(num_blocks, block_size)) for spec in specs) * element_size
        # Every running request may hold a full buffer in every layer: [num_resident_blocks, block_size, row].
        buffer_bytes = max_num_seqs * config.num_resident_blocks * block_size * element_size * sum(
            spec.elements_per_token() for spec in specs)
        key_bytes = num_blocks * sum(spec.bytes_per_block(block_size, dtype) for spec in specs) - tier_bytes
        check_offload_fits(config, tier_bytes=tier_bytes, resident_bytes=key_bytes + buffer_bytes,
                           available_bytes=platform.available_memory_bytes(), max_num_seqs=max_num_seqs)
        self.tier = OffloadTier([spec.tensor_shape(num_blocks, block_size) for spec in specs], dtype,
                                config.tier_directory)
        self.stats = SparseKVOffloadStats()
        self._step = StepRequests()
        self.layer_buffers: list[LayerResidentBuffers] = []
        # One cache per layer, in attention_layers order: its tier region, with the resident components attached.
        self.kv_caches: list[torch.Tensor] = []
        resident_bytes = 0
        for spec, tier_rows in zip(specs, self.tier.layer_views):
            components = {PRIMARY_COMPONENT: tier_rows}
            if spec.extra_components:
                layout = KVPageLayout.pack(block_size, [
                    KVCacheComponent(extra.name, extra.dtype or dtype, extra.per_token_shape)
                    for extra in spec.extra_components], is_interleaved=len(spec.extra_components) > 1)
                components |= kv_cache_components(layout.allocate(num_blocks, platform.allocate_zeros))
                resident_bytes += num_blocks * layout.page_bytes
            attach_kv_cache_components(tier_rows, components)
            self.kv_caches.append(tier_rows)
            self.layer_buffers.append(LayerResidentBuffers(tier_rows, config.num_resident_blocks, self._step,
                                                           self.stats))
        logger.info("sparse KV offload: %d layers; resident index keys %.1f MiB; latent tier %.1f MiB; resident "
                    "buffers of %d blocks per request and layer (at most %.1f MiB at max_num_seqs=%d)", len(layers),
                    resident_bytes / 2**20, self.tier.num_bytes / 2**20, config.num_resident_blocks,
                    buffer_bytes / 2**20, max_num_seqs)

    def bind(self) -> None:
        """Route the layers' decode gathers through their resident buffers (after their caches are bound)."""
        for layer, buffers in zip(self.layers, self.layer_buffers):
            layer.decode_row_gather = buffers.gather_decode_rows

    def free_requests(self, request_ids: set[str]) -> None:
        """Drop the resident buffers of finished or preempted requests."""
        if request_ids:
            for buffers in self.layer_buffers:
                buffers.free(request_ids)

    def begin_step(self, request_ids: list[str], num_scheduled: np.ndarray) -> None:
        """The step's requests in attention-metadata row order, with their token counts. A request computing
        several tokens (a prefill chunk) starts over with empty buffers."""
        self._step.request_ids = request_ids
        multi_token = [request_id for request_id, count in zip(request_ids, num_scheduled.tolist()) if count > 1]
        self.free_requests(set(multi_token))
        self.stats.num_tokens_moved_out += int(num_scheduled.sum()) * len(self.layers)

    def make_stats(self) -> SparseKVOffloadStats:
        """The counters so far, with the current gauges."""
        return dataclasses.replace(
            self.stats,
            num_resident_blocks=sum(buffers.num_resident_blocks for buffers in self.layer_buffers),
            num_resident_buffers=sum(len(buffers.buffers) for buffers in self.layer_buffers))

    def close(self) -> None:
        """Drop every resident buffer and the tier's views (engine shutdown; idempotent)."""
        for buffers in self.layer_buffers:
            buffers.buffers.clear()
        self.tier.close()


__all__ = ["SparseKVOffload"]
