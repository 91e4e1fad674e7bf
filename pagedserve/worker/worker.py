"""Worker: one rank's device, model, KV cache and model runner."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedserve.attention import use_attention_backend
from pagedserve.config.engine import EngineConfig
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.distributed.worker_init import agree_on_min, initialize_worker_distributed
from pagedserve.eplb.eplb_step_hook import EplbStepHook
from pagedserve.kv_transfer.connector_base import KVConnectorWorker
from pagedserve.layers.moe.moe_options import moe_options_from_engine_config, use_moe_options
from pagedserve.model_loader import load_model
from pagedserve.layers.weight_layout import resolve_weight_layout
from pagedserve.model_loader.model_source import open_model_source
from pagedserve.platforms import current_platform
from pagedserve.platforms.cpu_binding import bind_worker_cpus
from pagedserve.spec_decode.drafter_loading import load_draft_model
from pagedserve.worker.kv_cache_allocation import (allocate_kv_caches, determine_num_kv_blocks,
                                                   kv_bytes_per_block)
from pagedserve.worker.model_runner import ModelRunner

if TYPE_CHECKING:  # imported only when sparse KV offload is on
    from pagedserve.sparse_kv_offload.offload_manager import SparseKVOffload

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeInfo:
    """Values derived at start (never written back into the config)."""

    num_kv_blocks: int
    kv_cache_bytes: int
    attention_backend: str
    # (num_tokens, num_history_tokens, seconds) of the start-up chunk profiling; empty when it is off.
    chunk_latency_samples: tuple[tuple[int, int, float], ...] = ()
    # The port the KV connector serves this engine's blocks on (0: none): rank 0's.
    kv_transfer_port: int = 0
    # Every rank's KV connector port, in rank order (the executor collects them; () without a connector).
    kv_transfer_ports: tuple[int, ...] = ()


class Worker:
    """`rank` / `distributed_init_method` place this worker in its engine's TP x PP world (the
    multiprocess and Ray executors pass them; a single-process engine leaves them at their defaults)."""

    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None) -> None:
        self.config = config
        self.rank = rank
        self.platform = current_platform()
        self.world_size = config.parallel_config.world_size_per_engine
        if self.world_size > 1:
            initialize_worker_distributed(config.parallel_config, rank, distributed_init_method, self.platform)
        self.device = self.platform.device
        if config.num_cpu_threads is not None:
            torch.set_num_threads(config.num_cpu_threads)
        if config.enable_cpu_binding and self.device.type == "cpu":
            bind_worker_cpus(rank, self.world_size, keep_num_threads=config.num_cpu_threads is not None)
        # Every rank seeds alike: ranks sample from identical (gathered) logits with identical RNG
        # streams, so their persistent batches append the same tokens without a broadcast.
        torch.manual_seed(config.model_config.seed)
        model_config = config.model_config
        source = open_model_source(model_config.model)
        weights = source.weights(model_config.dtype, keep_quantized=not config.load_config.gguf_dequantize)
        # After loading, linear weights take the platform's preferred layout (layers/weight_layout.py).
        weight_layout = resolve_weight_layout(config.load_config.weight_layout, self.device.type,
                                              model_config.dtype, config.batch_invariant)
        # MoE layers read the EP / redundant-expert / overlap options while they are built; attention
        # layers take the configured backend.
        with use_moe_options(moe_options_from_engine_config(config)), \
                use_attention_backend(config.attention_backend):
            # With several ranks each reads only the checkpoint slices its weight loaders keep.
            model = load_model(model_config, self.device, weights=weights, load_config=config.load_config,
                               read_slices=self.world_size > 1, weight_layout=weight_layout)
            # Speculative decoding's drafter model, when its method runs one (else None).
            draft_model = load_draft_model(config, self.device, read_slices=self.world_size > 1,
                                           weight_layout=weight_layout, target=model)
        if config.parallel_config.enable_sequence_parallel:
            from pagedserve.distributed.parallel_state import get_tp_group
            from pagedserve.distributed.sequence_parallel import apply_sequence_parallel

            apply_sequence_parallel(model, get_tp_group())
        if config.load_config.huge_page_weights:
            self.platform.place_weights(model)
        # EPLB: the periodic rebalance driver (None when disabled); it runs after each executed step.
        self.eplb_hook = EplbStepHook(model, config.eplb_config) if config.eplb_config.enable else None
        self.model_runner = ModelRunner(config, model, self.device, draft_model)
        cache_config = config.cache_config
        kv_cache_modules = self.model_runner.kv_cache_modules
        bytes_per_block = kv_bytes_per_block(kv_cache_modules, cache_config.block_size, model_config.dtype,
                                             cache_config.kv_cache_dtype)
        num_blocks = determine_num_kv_blocks(cache_config, bytes_per_block,
                                             self.platform.available_memory_bytes(),
                                             model_config.max_model_len,
                                             config.scheduler_config.max_num_seqs, config.tokens_per_block)
        if self.world_size > 1:
            # Ranks see different free memory: all of them use the smallest count.
            num_blocks = agree_on_min(num_blocks, self.device)
        # Sparse KV offload (sparse_kv_offload/): the DSA layers' latents in a second tier; None when off.
        self.kv_offload: SparseKVOffload | None = None
        if config.sparse_kv_offload_config is not None:
            from pagedserve.sparse_kv_offload.offload_manager import SparseKVOffload

            self.kv_offload = SparseKVOffload(config.sparse_kv_offload_config, kv_cache_modules, num_blocks,
                                              cache_config.block_size, model_config.dtype, self.platform,
                                              config.scheduler_config.max_num_seqs)
            kv_caches = self.kv_offload.kv_caches
        else:
            kv_caches = allocate_kv_caches(kv_cache_modules, num_blocks, cache_config.block_size,
                                           model_config.dtype, self.platform, cache_config.kv_cache_dtype)
        self.model_runner.bind_kv_caches(kv_caches)
        if self.kv_offload is not None:
            self.kv_offload.bind()
            self.model_runner.kv_offload = self.kv_offload
        # The KV connector's worker side (kv_transfer/): moves KV pages between engines; None without one.
        self.kv_connector: KVConnectorWorker | None = None
        if config.kv_transfer_config is not None:
            from pagedserve.kv_transfer.connector_factory import connect_worker_kv_caches

            self.kv_connector = connect_worker_kv_caches(config, kv_cache_modules, kv_caches, num_blocks,
                                                         target_model=model, draft_model=draft_model)
            if self.kv_connector.saves_kv_per_layer:  # push mode: each attention layer hands over its KV
                self.model_runner.kv_layer_saver = self.kv_connector.save_kv_layer
        self.runtime_info = RuntimeInfo(num_kv_blocks=num_blocks, kv_cache_bytes=num_blocks * bytes_per_block,
                                        attention_backend=config.attention_backend,
                                        chunk_latency_samples=self._profile_chunk_latencies(model, num_blocks),
                                        kv_transfer_port=self.kv_connector.port if self.kv_connector else 0,
                                        kv_transfer_ports=(self.kv_connector.port,) if self.kv_connector else ())
        logger.info("KV cache (%s): %d blocks of %d tokens (%.1f MiB)%s, max %d concurrent tokens",
                    cache_config.kv_cache_dtype, num_blocks, cache_config.block_size,
                    num_blocks * bytes_per_block / 2**20, config.parallel_config.kv_split_note(),
                    (num_blocks - 1) * config.tokens_per_block)
        self.platform.prepare_for_serving()

    def _profile_chunk_latencies(self, model: torch.nn.Module,
                                 num_blocks: int) -> tuple[tuple[int, int, float], ...]:
        """Start-up forward timings for profiling-tuned chunked prefill (empty when it is off)."""
        profiling = self.config.profiling_chunk_config
        if not profiling.enable:
            return ()
        from pagedserve.worker.chunk_latency_profiler import profile_chunk_latencies, profile_points

        block_size = self.config.cache_config.block_size
        points = profile_points(profiling.chunk_sizes, profiling.history_sizes,
                                self.config.scheduler_config.max_num_batched_tokens,
                                self.config.model_config.max_model_len, (num_blocks - 1) * block_size)
        samples = profile_chunk_latencies(model, self.device, block_size, self.config.model_config.vocab_size,
                                          points)
        logger.info("chunk profiling: %s", ", ".join(
            f"{s.num_tokens}+{s.num_history_tokens}h: {s.seconds * 1000:.1f} ms" for s in samples))
        return tuple((s.num_tokens, s.num_history_tokens, s.seconds) for s in samples)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        connector = self.kv_connector
        if connector is not None:
            connector.start_load_kv(scheduler_output.kv_connector_metadata)
        output = self.model_runner.execute_model(scheduler_output)
        if self.kv_offload is not None:
            output.sparse_kv_offload_stats = self.kv_offload.make_stats()
        if connector is not None:
            connector.wait_for_save()
            output.kv_connector_output = connector.get_finished(scheduler_output.finished_request_ids)
        if self.eplb_hook is not None and scheduler_output.total_num_scheduled_tokens:
            report = self.eplb_hook.after_step()
            if report is not None:
                output.eplb_imbalance = list(zip(report.imbalance_before, report.imbalance_after))
        return output

    def shutdown(self) -> None:
        """Release sparse KV offload's tier and buffers and stop the KV connector's threads and sockets."""
        if self.kv_offload is not None:
            self.kv_offload.close()
        if self.kv_connector is not None:
            self.model_runner.kv_layer_saver = None
            self.kv_connector.shutdown()
            self.kv_connector = None
