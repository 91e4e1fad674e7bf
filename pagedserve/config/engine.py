"""EngineConfig: every concern's config in one frozen object, built and cross-validated once.

`EngineConfig.create(**kwargs)` is the single place where user knobs (LLM keyword arguments and CLI
flags share these names) become validated configs. Derived runtime values (the number of KV blocks,
the chosen attention backend) are not written back here: the worker returns them at start.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from pagedserve.config.cache import CacheConfig, parse_memory_size
from pagedserve.config.compilation import CompilationConfig
from pagedserve.config.eplb import EplbConfig
from pagedserve.config.kv_transfer import KVTransferConfig
from pagedserve.config.load import LoadConfig
from pagedserve.config.model import ModelConfig, derived_max_model_len, resolve_dtype
from pagedserve.config.parallel import DyntraLBConfig, ParallelConfig
from pagedserve.config.profiling_chunk import ProfilingChunkConfig
from pagedserve.config.scheduler import SchedulerConfig
from pagedserve.config.sparse_kv_offload import SparseKVOffloadConfig
from pagedserve.config.speculative import SpeculativeConfig
from pagedserve.config.structured_outputs import StructuredOutputsConfig
from pagedserve.kernels import cpu_isa


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    attention_backend: str = "torch_paged"
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    # Intra-op threads of the worker's torch ops; None keeps torch's default (every core).
    num_cpu_threads: int | None = None
    # MoE: expert-parallel load balancing, and the shared experts on a side stream (a no-op on the CPU).
    eplb_config: EplbConfig = field(default_factory=EplbConfig)
    multistream_overlap_shared_expert: bool = False
    # Pin each worker rank and its torch threads to distinct physical cores (platforms/cpu_binding.py).
    enable_cpu_binding: bool = False
    # Profiling-tuned prefill chunk sizes (core/profiling_chunk_predictor.py); off by default.
    profiling_chunk_config: ProfilingChunkConfig = field(default_factory=ProfilingChunkConfig)
    # Graph capture of the model forward and its fusion passes, resolved (config/compilation.py).
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    # A request's logits are bitwise identical whatever else is in the batch (pagedserve/batch_invariant/).
    batch_invariant: bool = False
    # Checkpoint read strategy and threads, and the linear weight layout after loading (config/load.py).
    load_config: LoadConfig = field(default_factory=LoadConfig)
    # Decode-only steps of qualifying Llama-family models in one native call (models/native_decode_stack.py).
    native_decode_stack: bool = True
    # Speculative decoding (config/speculative.py, spec_decode/); off unless a method is set.
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # Sparse KV offload of DeepSeek sparse-attention models (config/sparse_kv_offload.py); None: off.
    sparse_kv_offload_config: SparseKVOffloadConfig | None = None
    # The KV connector (config/kv_transfer.py, kv_transfer/): prefill/decode disaggregation; None when off.
    kv_transfer_config: KVTransferConfig | None = None

    # Structured outputs' grammar engine (config/structured_outputs.py, structured_output/).
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)

    @property
    def tokens_per_block(self) -> int:
        """Positions one KV block id covers: block_size on each rank's page, times the PCP x DCP ranks that split
        the positions (attention/decode_context_parallel.py). The scheduler counts these."""
        return self.cache_config.block_size * self.parallel_config.context_parallel_size

    def for_data_parallel_rank(self, data_parallel_rank: int) -> "EngineConfig":
        """The config DP rank `data_parallel_rank` runs as its own engine (engine/dp_engine_core.py): its KV
        connector gets its own engine id and ports (KVTransferConfig.for_data_parallel_rank); the rest is shared."""
        if self.kv_transfer_config is None:
            return self
        return dataclasses.replace(self, kv_transfer_config=self.kv_transfer_config.for_data_parallel_rank(
            data_parallel_rank, self.parallel_config.world_size_per_engine))

    @staticmethod
    def create(
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        block_size: int = 16,
        kv_cache_memory: int | str | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_dtype: str = "auto",
        seed: int = 0,
        scheduling_policy: str = "fcfs",
        long_prefill_token_threshold: int = 0,
        async_scheduling: bool = False,
        attention_backend: str | None = None,
        num_cpu_threads: int | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        distributed_executor_backend: str | None = None,
        lmhead_tensor_parallel_size: int = 0,
        embedding_tensor_parallel_size: int = 0,
        oproj_tensor_parallel_size: int = 0,
        enable_reduce_sample: bool = False,
        decode_context_parallel_size: int = 1,
        prefill_context_parallel_size: int = 1,
        enable_sequence_parallel: bool = False,
        enable_balance_scheduling: bool = False,
        dyntra_lb_config: DyntraLBConfig | dict[str, Any] | str | None = None,
        eplb_config: EplbConfig | dict[str, Any] | str | None = None,
        multistream_overlap_shared_expert: bool = False,
        enable_cpu_binding: bool = False,
        profiling_chunk_config: ProfilingChunkConfig | dict[str, Any] | str | None = None,
        compilation_config: CompilationConfig | dict[str, Any] | str | None = None,
        enforce_eager: bool = False,
        batch_invariant: bool = False,
        enable_multithread_load: bool = False,
        num_threads: int = 8,
        safetensors_load_strategy: str = "lazy",
        weight_layout: str = "auto",
        huge_page_weights: bool = True,
        gguf_dequantize: bool = False,
        native_decode_stack: bool = True,
        speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None,
        sparse_kv_offload: SparseKVOffloadConfig | dict[str, Any] | str | None = None,
        kv_transfer_config: KVTransferConfig | dict[str, Any] | str | None = None,
        structured_outputs_config: StructuredOutputsConfig | dict[str, Any] | str | None = None,
        reasoning_parser: str | None = None,
    ) -> "EngineConfig":
        from pagedserve.model_loader.model_source import open_model_source
        from pagedserve.platforms import current_platform

        parallel_config = ParallelConfig(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
            enable_expert_parallel=enable_expert_parallel,
            distributed_executor_backend=distributed_executor_backend,
            lmhead_tensor_parallel_size=lmhead_tensor_parallel_size,
            embedding_tensor_parallel_size=embedding_tensor_parallel_size,
            oproj_tensor_parallel_size=oproj_tensor_parallel_size,
            enable_reduce_sample=enable_reduce_sample,
            decode_context_parallel_size=decode_context_parallel_size,
            prefill_context_parallel_size=prefill_context_parallel_size,
            enable_sequence_parallel=enable_sequence_parallel,
            enable_balance_scheduling=enable_balance_scheduling,
            dyntra_lb_config=DyntraLBConfig.parse(dyntra_lb_config),
        )
        source = open_model_source(model)
        hf_config = source.hf_config
        platform = current_platform()
        if platform.device_type == "cpu":
            cpu_isa.cap_from_environment()  # an unknown PAGEDSERVE_CPU_ISA is an error at start, naming the levels
        parallel_config.validate_for_model(hf_config, num_cpus=os.cpu_count(),
                                           num_devices=_num_devices(platform.device_type))
        torch_dtype = resolve_dtype(dtype, hf_config)
        platform.check_dtype(torch_dtype)

        limit = derived_max_model_len(hf_config)
        if max_model_len is None:
            max_model_len = limit
        elif not isinstance(max_model_len, int) or not 1 <= max_model_len <= limit:
            raise ValueError(
                f"max_model_len={max_model_len!r} must be an integer in [1, {limit}] "
                f"(the model's max_position_embeddings)"
            )
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 2048 if enable_chunked_prefill else max(2048, max_model_len)

        model_config = ModelConfig(
            model=source.path,
            tokenizer=tokenizer or source.tokenizer_path,
            dtype=torch_dtype,
            max_model_len=max_model_len,
            seed=seed,
            hf_config=hf_config,
        )
        cache_config = CacheConfig(
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_memory=parse_memory_size(kv_cache_memory),
            num_kv_blocks=num_kv_blocks,
            kv_cache_dtype=kv_cache_dtype,
        )
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            policy=scheduling_policy,
            long_prefill_token_threshold=long_prefill_token_threshold,
            async_scheduling=async_scheduling,
        )
        from pagedserve.attention import attention_backend_names

        if attention_backend is not None and attention_backend not in attention_backend_names():
            raise ValueError(f"attention_backend={attention_backend!r} must be one of {attention_backend_names()} "
                             f"(or None: the platform's default)")
        if num_cpu_threads is not None and (not isinstance(num_cpu_threads, int) or num_cpu_threads < 1):
            raise ValueError(f"num_cpu_threads={num_cpu_threads!r} must be an integer >= 1 (or None: all cores)")
        if not isinstance(multistream_overlap_shared_expert, bool):
            raise ValueError(f"multistream_overlap_shared_expert={multistream_overlap_shared_expert!r} must be "
                             f"true or false")
        if not isinstance(enable_cpu_binding, bool):
            raise ValueError(f"enable_cpu_binding={enable_cpu_binding!r} must be true or false")
        if not isinstance(native_decode_stack, bool):
            raise ValueError(f"native_decode_stack={native_decode_stack!r} must be true or false")
        profiling_chunk = ProfilingChunkConfig.parse(profiling_chunk_config)
        if profiling_chunk.enable and not enable_chunked_prefill:
            raise ValueError("profiling_chunk_config.enable=True sizes prefill chunks, but "
                             "enable_chunked_prefill=False: enable chunked prefill or disable profiling_chunk_config")
        if profiling_chunk.enable and parallel_config.pipeline_parallel_size > 1:
            raise ValueError(f"profiling_chunk_config.enable=True times whole-model forwards, but "
                             f"pipeline_parallel_size={parallel_config.pipeline_parallel_size} splits the model "
                             f"over stages: disable profiling_chunk_config or use pipeline_parallel_size=1")
        if async_scheduling and parallel_config.pipeline_parallel_size > 1:
            # A placeholder decode feeds the token sampled by the step before, which only the last stage
            # holds; the other stages learn tokens from the scheduler, which has not seen it yet.
            raise ValueError(f"async_scheduling=True is not supported with pipeline_parallel_size="
                             f"{parallel_config.pipeline_parallel_size} (stages before the last learn sampled "
                             f"tokens from the scheduler); pipeline micro-batches already overlap steps: "
                             f"set async_scheduling=False or pipeline_parallel_size=1")
        speculative = SpeculativeConfig.parse(speculative_config)
        speculative.check_drafter(hf_config, tokenizer or source.tokenizer_path, max_model_len,
                                 target_model=source.path if source.kind == "hf" else None)
        speculative.check_engine(async_scheduling=async_scheduling,
                                 pipeline_parallel_size=parallel_config.pipeline_parallel_size,
                                 enable_reduce_sample=enable_reduce_sample)
        sparse_kv_offload_config = SparseKVOffloadConfig.parse(sparse_kv_offload)
        if sparse_kv_offload_config is not None and parallel_config.prefill_context_parallel_size > 1:
            raise ValueError(f"sparse_kv_offload is not supported with prefill_context_parallel_size="
                             f"{parallel_config.prefill_context_parallel_size} yet (its tier holds one rank's "
                             f"latents); turn one of them off")
        if sparse_kv_offload_config is not None:
            sparse_kv_offload_config.check_engine(
                architectures=list(getattr(hf_config, "architectures", None) or []), kv_cache_dtype=kv_cache_dtype,
                device_type=platform.device_type, speculative_enabled=speculative.is_enabled,
                tensor_parallel_size=parallel_config.tensor_parallel_size,
                pipeline_parallel_size=parallel_config.pipeline_parallel_size)
        kv_transfer = KVTransferConfig.parse(kv_transfer_config)
        if kv_transfer is not None:
            kv_transfer.check_engine(parallel_config, speculative.method if speculative.is_enabled else None,
                                     sparse_kv_offload=sparse_kv_offload_config is not None)
        compilation = CompilationConfig.parse(compilation_config).resolve(
            max_num_batched_tokens=max_num_batched_tokens, enforce_eager=enforce_eager,
            device_type=platform.device_type)
        from pagedserve.batch_invariant import batch_invariant_from_env, check_batch_invariant_options

        if batch_invariant is False and batch_invariant_from_env():  # vLLM's VLLM_BATCH_INVARIANT=1
            batch_invariant = True
        attention_backend = parallel_config.attention_backend_for(attention_backend, batch_invariant)
        parallel_config.check_context_parallel_modes(compilation.is_compiled, speculative.method,
                                                     speculative.reads_target_hidden_states, profiling_chunk.enable)
        check_batch_invariant_options(batch_invariant, attention_backend, compilation.mode)
        if batch_invariant:
            attention_backend = attention_backend or "torch_paged"  # its layout; layers get its invariant form
        # Kept GGUF blocks pick their product unit by batch size (layers/gguf_linear.py): batch-invariant runs
        # dequantize them at load, as they keep plain layouts.
        load_config = LoadConfig(enable_multithread_load=enable_multithread_load, num_threads=num_threads,
                                 safetensors_load_strategy=safetensors_load_strategy, weight_layout=weight_layout,
                                 huge_page_weights=huge_page_weights,
                                 gguf_dequantize=gguf_dequantize or batch_invariant)
        from pagedserve.layers.weight_layout import resolve_weight_layout

        # Fails here, not in the worker, when the layout cannot be honoured (platform, dtype, modes).
        resolve_weight_layout(weight_layout, platform.device_type, torch_dtype, batch_invariant)
        return EngineConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            attention_backend=attention_backend or platform.default_attention_backend(),
            parallel_config=parallel_config,
            num_cpu_threads=num_cpu_threads,
            eplb_config=EplbConfig.from_value(eplb_config),
            multistream_overlap_shared_expert=multistream_overlap_shared_expert,
            enable_cpu_binding=enable_cpu_binding,
            profiling_chunk_config=profiling_chunk,
            compilation_config=compilation,
            batch_invariant=batch_invariant,
            load_config=load_config,
            native_decode_stack=native_decode_stack,
            speculative_config=speculative,
            sparse_kv_offload_config=sparse_kv_offload_config,
            kv_transfer_config=kv_transfer,
            structured_outputs_config=StructuredOutputsConfig.parse(structured_outputs_config).with_reasoning_parser(
                reasoning_parser),
        )


def _num_devices(device_type: str) -> int | None:
    """Accelerators a TP x PP world may spread over (None on the CPU, where cores are the limit)."""
    if device_type == "cuda":
        import torch

        return torch.cuda.device_count()
    return None


def engine_kwargs_names() -> tuple[str, ...]:
    """The keyword arguments EngineConfig.create accepts (LLM(...) and CLI flags use the same names)."""
    code = EngineConfig.create.__code__
    return code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]


__all__ = ["EngineConfig", "engine_kwargs_names"]
