"""The feature panorama: one row per feature of SEED_FEATURES.md that this build implements.

A row appears only when the feature works. tests/test_features.py checks every row: its modules
import, its knobs are real configuration fields, its docs page exists and its tests are collected.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Feature:
    line: str  # 'model' | 'framework'
    family: str  # L1 of SEED_FEATURES.md
    feature: str
    modules: tuple[str, ...]
    knobs: tuple[str, ...]  # EngineConfig.create keywords or SamplingParams fields
    docs: str
    tests: tuple[str, ...]  # pytest node ids


FEATURES: tuple[Feature, ...] = (
    Feature(
        line="framework", family="prefix cache", feature="hash-chained full-block prefix cache",
        modules=("pagedserve.core.block_pool", "pagedserve.core.block_hash", "pagedserve.core.kv_cache_manager"),
        knobs=("enable_prefix_caching",),
        docs="docs/params-01-scheduling.md",
        tests=("tests/e2e/test_feature_equivalence.py::test_prefix_caching_on_off_equal",
               "tests/core/test_kv_cache_manager.py"),
    ),
    Feature(
        line="framework", family="chunked prefill", feature="chunked prefill under one token budget",
        modules=("pagedserve.core.scheduler",),
        knobs=("enable_chunked_prefill", "max_num_batched_tokens", "long_prefill_token_threshold"),
        docs="docs/params-01-scheduling.md",
        tests=("tests/e2e/test_feature_equivalence.py::test_chunked_prefill_tiny_budget_equal",
               "tests/core/test_scheduler.py"),
    ),
    Feature(
        line="framework", family="kv cache mgmt", feature="paged KV cache: block pool, KV manager, preemption",
        modules=("pagedserve.core.block_pool", "pagedserve.core.kv_cache_manager",
                 "pagedserve.worker.kv_cache_allocation", "pagedserve.attention.torch_paged"),
        knobs=("block_size", "kv_cache_memory", "num_kv_blocks", "max_num_seqs", "scheduling_policy"),
        docs="docs/params-01-scheduling.md",
        tests=("tests/e2e/test_feature_equivalence.py::test_preemption_equal",
               "tests/core/test_block_pool.py", "tests/attention/test_torch_paged.py"),
    ),
    Feature(
        line="framework", family="kv cache mgmt", feature="int8 KV cache: byte pages of int8 K/V with float32 "
                                                         "per-token-per-head scales in the same page (~2x the "
                                                         "tokens of bf16), read in place by torch_paged and the "
                                                         "cpu_native decode and prefill kernels and the native "
                                                         "decode stack; MLA latent cache in int8",
        modules=("pagedserve.attention.kv_quantization", "pagedserve.worker.kv_cache_allocation",
                 "pagedserve.attention.cpu_native", "pagedserve.attention.mla_paged"),
        knobs=("kv_cache_dtype",),
        docs="docs/params-01-scheduling.md",
        tests=("tests/e2e/test_int8_kv_cache_engine.py", "tests/attention/test_int8_kv_cache.py",
               "tests/attention/test_native_int8_kv.py", "tests/attention/test_native_int8_prefill.py",
               "tests/models/test_native_decode_stack_int8_kv.py", "tests/moe/test_mla_int8_cache.py"),
    ),
    Feature(
        line="framework", family="kv cache mgmt", feature="multi-component KV pages: a layer's spec lists its "
                                                         "components (dtype, planes, per-token shape) at byte "
                                                         "offsets of one page; typed views over one byte buffer "
                                                         "per layer, one block-id pool for every component "
                                                         "(int8 data + scales; MLA latent + DSA indexer keys; "
                                                         "the DSA C8 page)",
        modules=("pagedserve.attention.kv_page_layout", "pagedserve.attention.kv_cache_spec",
                 "pagedserve.worker.kv_cache_allocation"),
        knobs=(),
        docs="docs/params-04-kv-and-sparsity.md",
        tests=("tests/attention/test_kv_page_layout.py",),
    ),
    Feature(
        line="framework", family="fused ops", feature="native CPU paged attention ('cpu_native'): decode "
                                                      "kernel reading K/V in place through the block table "
                                                      "(GQA-grouped, flash-decoding partitions, AVX-512 fp32, "
                                                      "AVX512-BF16 dot products for bf16), flash attention for "
                                                      "bf16 prefills on AMX tiles or AVX512-BF16 dot products "
                                                      "and fp32 prefills on FMA, native K/V write; batch "
                                                      "invariant; "
                                                      "JIT-built, cached, torch_paged fallback",
        modules=("pagedserve.attention.cpu_native", "pagedserve.kernels.cpu_library"),
        knobs=("attention_backend",),
        docs="docs/params-03-attention-backends.md",
        tests=("tests/attention/test_cpu_native.py", "tests/attention/test_prefill_attention.py"),
    ),
    Feature(
        line="framework", family="sample", feature="sampler: greedy, temperature, top-k/p, min-p, penalties, "
                                                 "seeds, logprobs",
        modules=("pagedserve.sample.sampler", "pagedserve.sample.sampling_metadata"),
        knobs=("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "seed", "logprobs", "prompt_logprobs"),
        docs="docs/params-01-scheduling.md",
        tests=("tests/sample/", "tests/e2e/test_sampling_e2e.py::test_seed_same_alone_and_in_batch"),
    ),
    Feature(
        line="framework", family="model_runner_v2", feature="persistent-batch model runner",
        modules=("pagedserve.worker.model_runner", "pagedserve.worker.input_batch"),
        knobs=(),
        docs="docs/architecture.md",
        tests=("tests/e2e/test_feature_equivalence.py::test_batch_of_32_equals_alone",
               "tests/e2e/test_hf_parity.py"),
    ),
    Feature(
        line="model", family="parallel", feature="tensor parallel over gloo/nccl worker processes ('mp') or "
                                                 "Ray actors in a placement group ('ray', multi-node), sharded "
                                                 "safetensors loading, KV-head replication",
        modules=("pagedserve.distributed.parallel_state", "pagedserve.executor.multiproc",
                 "pagedserve.executor.ray_executor", "pagedserve.model_loader.checkpoint_slice",
                 "pagedserve.config.parallel"),
        knobs=("tensor_parallel_size", "distributed_executor_backend"),
        docs="docs/params-05-parallel.md",
        tests=("tests/distributed/test_tensor_parallel.py", "tests/distributed/test_worker_death.py",
               "tests/distributed/test_parallel_config.py", "tests/distributed/test_ray_executor.py",
               "tests/distributed/test_ray_session.py", "tests/distributed/test_ray_multi_node.py",
               "tests/distributed/test_step_failure.py"),
    ),
    Feature(
        line="model", family="parallel", feature="pipeline parallel: layers split over stages (each builds, "
                                                 "loads and caches only its own), intermediate tensors over "
                                                 "send/recv, sampled tokens in the step deltas, one micro-batch "
                                                 "per stage in flight",
        modules=("pagedserve.models.pipeline_split", "pagedserve.distributed.pipeline_comm",
                 "pagedserve.worker.pipeline_stage_forward", "pagedserve.executor.multiproc"),
        knobs=("pipeline_parallel_size",),
        docs="docs/params-05-parallel.md",
        tests=("tests/distributed/test_pipeline_parallel.py",),
    ),
    Feature(
        line="model", family="parallel", feature="decode context parallel: each request's KV positions split "
                                                 "over consecutive TP ranks, partial attention merged by "
                                                 "log-sum-exp (dense/GQA, MLA, DeepSeek sparse attention "
                                                 "with a global top-k over the ranks' candidates)",
        modules=("pagedserve.attention.decode_context_parallel", "pagedserve.attention.sparse_mla_context_parallel"),
        knobs=("decode_context_parallel_size",),
        docs="docs/params-05-parallel.md",
        tests=("tests/attention/test_decode_context_parallel.py",
               "tests/distributed/test_decode_context_parallel_engine.py"),
    ),
    Feature(
        line="model", family="parallel", feature="prefill context parallel: added ranks (world = TP x PP x PCP) "
                                                 "split each step's tokens; KV positions split over PCP x DCP "
                                                 "ranks, queries gathered, partials merged by log-sum-exp "
                                                 "(dense/GQA, MLA, DeepSeek sparse attention)",
        modules=("pagedserve.distributed.prefill_context_parallel", "pagedserve.attention.decode_context_parallel"),
        knobs=("prefill_context_parallel_size",),
        docs="docs/params-05-parallel.md",
        tests=("tests/distributed/test_prefill_context_parallel_engine.py",),
    ),
    Feature(
        line="model", family="parallel", feature="sequence parallel for TP (Llama form): residual stream split by "
                                                 "tokens, reduce-scatter / all-gather instead of all-reduce",
        modules=("pagedserve.distributed.sequence_parallel",),
        knobs=("enable_sequence_parallel",),
        docs="docs/params-05-parallel.md",
        tests=("tests/distributed/test_sequence_parallel.py",),
    ),
    Feature(
        line="model", family="parallel", feature="fine-grained TP: LM head, word embedding, o_proj degrees",
        modules=("pagedserve.layers.output_projection", "pagedserve.layers.embedding"),
        knobs=("lmhead_tensor_parallel_size", "embedding_tensor_parallel_size", "oproj_tensor_parallel_size"),
        docs="docs/params-05-parallel.md",
        tests=("tests/distributed/test_fine_grained_tp.py::"
               "test_replicated_head_embedding_oproj_and_kv_head_replication",),
    ),
    Feature(
        line="framework", family="sample", feature="reduce_sample: gather top-k candidates, not full logits",
        modules=("pagedserve.sample.reduce_sample",),
        knobs=("enable_reduce_sample",),
        docs="docs/params-05-parallel.md",
        tests=("tests/distributed/test_fine_grained_tp.py::test_reduce_sample_exact_for_greedy_and_top_k",),
    ),
    Feature(
        line="framework", family="DPLB", feature="data parallel engine cores with least-loaded routing, "
                                               "balance gate and DyntraLB bubble gate",
        modules=("pagedserve.engine.dp_engine_core", "pagedserve.distributed.dp_coordinator"),
        knobs=("data_parallel_size", "enable_balance_scheduling", "dyntra_lb_config"),
        docs="docs/params-05-parallel.md",
        tests=("tests/distributed/test_data_parallel.py",),
    ),
    Feature(
        line="framework", family="CPU-side", feature="CPU binding: ranks and torch threads on distinct "
                                                    "physical cores, NUMA-aware, engine core kept",
        modules=("pagedserve.platforms.cpu_binding",),
        knobs=("enable_cpu_binding",),
        docs="docs/params-02-cpu-binding.md",
        tests=("tests/platforms/test_cpu_binding.py",
               "tests/e2e/test_execution_features.py::test_cpu_binding_same_tokens"),
    ),
    Feature(
        line="framework", family="chunked prefill", feature="profiling-tuned chunk sizes: start-up latency "
                                                          "fit, TPOT-budgeted, smoothed, block-aligned",
        modules=("pagedserve.core.profiling_chunk_predictor", "pagedserve.core.prefill_chunk_policy",
                 "pagedserve.worker.chunk_latency_profiler", "pagedserve.config.profiling_chunk"),
        knobs=("profiling_chunk_config",),
        docs="docs/params-01-scheduling.md",
        tests=("tests/core/test_profiling_chunk_predictor.py", "tests/core/test_prefill_chunk_policy.py",
               "tests/e2e/test_execution_features.py::test_profiling_chunk_same_tokens_and_caps_chunks"),
    ),
    Feature(
        line="framework", family="async scheduling", feature="step t+1 scheduled while step t runs "
                                                           "(batch queue, output placeholders)",
        modules=("pagedserve.engine.batch_queue", "pagedserve.core.scheduler", "pagedserve.executor.uniproc"),
        knobs=("async_scheduling",),
        docs="docs/async-scheduling.md",
        tests=("tests/engine/test_async_scheduling.py", "tests/core/test_async_scheduler.py"),
    ),
    Feature(
        line="model", family="MoE", feature="fused MoE on the CPU (grouped experts, DeepSeek/GLM routing); "
                                            "Qwen2/3-MoE, Mixtral, DeepSeek-V2/V3, GLM-4.5 MoE models",
        modules=("pagedserve.layers.moe.fused_moe", "pagedserve.layers.moe.router", "pagedserve.models.qwen_moe",
                 "pagedserve.models.mixtral", "pagedserve.models.deepseek_v2", "pagedserve.models.glm4_moe"),
        knobs=(),
        docs="docs/params-05-eplb-moe.md",
        tests=("tests/moe/test_fused_moe.py", "tests/moe/test_moe_hf_parity.py"),
    ),
    Feature(
        line="model", family="quantization", feature="W8A8 int8 linear layers from compressed-tensors checkpoints "
                                                     "(int-quantized; per-channel int8 weights, per-token dynamic "
                                                     "or static per-tensor int8 activations, int32 accumulation), "
                                                     "loaded with no flag; TP-sharded weights and scales; "
                                                     "a native int8 kernel with the quantization in its prologue "
                                                     "and a W8A8 kind in the native decode stack; "
                                                     "`pagedserve quantize` writes them from an HF folder "
                                                     "(optionally with SmoothQuant and an ignore list)",
        modules=("pagedserve.layers.quantization.compressed_tensors_config",
                 "pagedserve.layers.quantization.w8a8_int8", "pagedserve.layers.quantization.int8_matmul",
                 "pagedserve.quantization.quantize_checkpoint", "pagedserve.quantization.smoothquant",
                 "pagedserve.quantization.calibration"),
        knobs=(),
        docs="docs/quantization.md",
        tests=("tests/quantization/test_w8a8_linear.py", "tests/quantization/test_w8a8_models.py",
               "tests/quantization/test_w8a8_bad_checkpoints.py", "tests/quantization/test_w8a8_native_kernel.py",
               "tests/quantization/test_w8a8_decode_stack.py", "tests/quantization/test_smoothquant.py"),
    ),
    Feature(
        line="model", family="quantization", feature="W8A8 int8 MoE experts: grouped int8 gate_up + SwiGLU + "
                                                     "re-quant of the down projection's input in one pass "
                                                     "(gmm_swiglu_quant), EP dispatch, EPLB moves the scales",
        modules=("pagedserve.layers.moe.w8a8_experts", "pagedserve.layers.moe.fused_moe",
                 "pagedserve.eplb.rebalancer"),
        knobs=(),
        docs="docs/quantization.md",
        tests=("tests/quantization/test_w8a8_moe.py",),
    ),
    Feature(
        line="model", family="fused ops", feature="norm + quant fusion: a residual RMSNorm feeding a W8A8 dynamic "
                                                  "linear produces the int8 activation and its scale in one op "
                                                  "(captured graphs)",
        modules=("pagedserve.compilation.add_rms_norm_fusion", "pagedserve.layers.quantization.int8_quant_op"),
        knobs=("compilation_config",),
        docs="docs/params-03-fused-operators.md",
        tests=("tests/compilation/test_norm_quant_fusion.py",),
    ),
    Feature(
        line="model", family="MLA", feature="multi-head latent attention: latent KV cache, weight absorption, "
                                            "per-layer KV cache specs",
        modules=("pagedserve.layers.mla_attention", "pagedserve.attention.mla_paged",
                 "pagedserve.attention.kv_cache_spec"),
        knobs=(),
        docs="docs/params-05-eplb-moe.md",
        tests=("tests/moe/test_mla_cache.py",),
    ),
    Feature(
        line="model", family="sparse attention", feature="DeepSeek sparse attention (DSA) for DeepseekV32ForCausalLM "
                                                         "and GlmMoeDsaForCausalLM (GLM-5): lightning indexer "
                                                         "(ReLU(q.k) weighted over index heads, top index_topk per "
                                                         "query) with its keys in the latent's pages, MLA over the "
                                                         "selected tokens only, GLM-5 'shared' indexer layers; "
                                                         "plain PyTorch (float or C8 int8 caches)",
        modules=("pagedserve.models.deepseek_v32", "pagedserve.models.glm_moe_dsa",
                 "pagedserve.layers.lightning_indexer", "pagedserve.layers.sparse_mla_attention",
                 "pagedserve.attention.lightning_indexer", "pagedserve.attention.sparse_mla"),
        knobs=(),
        docs="docs/params-04-kv-and-sparsity.md",
        tests=("tests/models/test_deepseek_sparse_attention.py", "tests/attention/test_lightning_indexer.py",
               "tests/models/test_deepseek_sparse_prefill.py"),
    ),
    Feature(
        line="model", family="sparse attention", feature="C8 int8 caches for DeepSeek sparse attention "
                                                         "(kv_cache_dtype='int8' on DeepSeek-V3.2 / GLM-5): latent "
                                                         "as int8 with float32 per-128-channel scales + bf16 rope, "
                                                         "indexer keys Hadamard-rotated int8 with per-token scales, "
                                                         "one page per block id; the indexer scores int8 keys in "
                                                         "place, sparse MLA dequantizes only the rows it gathers "
                                                         "(788 vs 1408 bytes a token at V3.2 dims)",
        modules=("pagedserve.attention.sparse_int8_cache", "pagedserve.attention.hadamard_rotation",
                 "pagedserve.attention.lightning_indexer", "pagedserve.attention.sparse_mla"),
        knobs=("kv_cache_dtype",),
        docs="docs/params-04-kv-and-sparsity.md",
        tests=("tests/attention/test_sparse_int8_cache.py",
               "tests/models/test_deepseek_sparse_attention.py::test_c8_greedy_stays_the_float_models_top_choice",
               "tests/models/test_deepseek_sparse_attention.py::"
               "test_c8_fits_a_max_model_len_in_80_percent_of_the_float_cache"),
    ),
    Feature(
        line="framework", family="kv cache mgmt", feature="sparse KV offload for DSA models: latent rows in a "
                                                         "memory-mapped tier file, indexer keys resident, per "
                                                         "request and layer an LRU buffer of the selected blocks "
                                                         "(only misses copied; any buffer size, gathered in rounds); "
                                                         "CPU only",
        modules=("pagedserve.sparse_kv_offload.offload_manager", "pagedserve.sparse_kv_offload.offload_tier",
                 "pagedserve.sparse_kv_offload.layer_resident_buffers",
                 "pagedserve.sparse_kv_offload.resident_block_set", "pagedserve.config.sparse_kv_offload"),
        knobs=("sparse_kv_offload",),
        docs="docs/params-04-kv-and-sparsity.md",
        tests=("tests/models/test_deepseek_sparse_kv_offload.py", "tests/sparse_kv_offload/test_resident_block_set.py",
               "tests/sparse_kv_offload/test_layer_resident_buffers.py", "tests/sparse_kv_offload/test_offload_tier.py",
               "tests/sparse_kv_offload/test_sparse_kv_offload_config.py",
               "tests/sparse_kv_offload/test_offload_stats_messages.py"),
    ),
    Feature(
        line="model", family="parallel", feature="expert parallel: experts over the EP group, all_to_all "
                                                 "dispatch/combine",
        modules=("pagedserve.layers.moe.fused_moe",),
        knobs=("enable_expert_parallel",),
        docs="docs/params-05-eplb-moe.md",
        tests=("tests/moe/test_expert_parallel.py", "tests/moe/test_expert_parallel_engine.py"),
    ),
    Feature(
        line="framework", family="EPLB", feature="expert load balancing: load recorder, 'default' and 'flashlb' "
                                                 "policies, weight moves, imbalance metrics",
        modules=("pagedserve.eplb.eplb_step_hook", "pagedserve.eplb.flashlb_policy", "pagedserve.eplb.rebalancer"),
        knobs=("eplb_config",),
        docs="docs/params-05-eplb-moe.md",
        tests=("tests/moe/test_eplb.py",),
    ),
    Feature(
        line="model", family="multi-stream", feature="shared-expert overlap flag: equal outputs on the CPU (streams are no-ops); "
                                                       "the CUDA side-stream path is not yet run on a GPU",
        modules=("pagedserve.layers.moe.shared_expert_overlap",),
        knobs=("multistream_overlap_shared_expert",),
        docs="docs/params-02-multistream.md",
        tests=("tests/moe/test_fused_moe.py::test_shared_expert_overlap_flag_changes_nothing_on_cpu",),
    ),
    Feature(
        line="framework", family="graph mode", feature="graph capture: torch.compile of the model forward on a "
                                                       "padded token-count ladder, attention split out as an "
                                                       "opaque op, on-disk Inductor cache, eager fallback "
                                                       "(CPU; off by default there). CUDA piecewise graphs "
                                                       "written but not yet run on a GPU",
        modules=("pagedserve.worker.compiled_forward", "pagedserve.compilation.attention_op",
                 "pagedserve.compilation.compiler_backend", "pagedserve.config.compilation"),
        knobs=("compilation_config", "enforce_eager"),
        docs="docs/params-06-compilation.md",
        tests=("tests/compilation/test_graph_capture.py::test_compiled_equals_eager_with_padding",
               "tests/compilation/test_graph_capture.py::test_chunked_prefill_mixed_batches_all_compiled",
               "tests/compilation/test_graph_capture.py::"
               "test_inductor_compiled_equals_eager_and_second_engine_hits_cache"),
    ),
    Feature(
        line="framework", family="graph mode", feature="native decode stack: decode-only steps of Llama-family "
                                                       "models (Llama, Mistral, Qwen2) run every layer in one "
                                                       "native call over the same kernels as the modules "
                                                       "(bitwise equal; CPU, on by default); all-greedy decode "
                                                       "steps also read their inputs from the persistent batch, "
                                                       "pick the LM head's argmax in the same call and append it",
        modules=("pagedserve.models.native_decode_stack",),
        knobs=("native_decode_stack",),
        docs="docs/params-06-compilation.md",
        tests=("tests/models/test_native_decode_stack.py",),
    ),
    Feature(
        line="framework", family="graph mode", feature="fusion passes wired into graph capture: add+RMSNorm, "
                                                       "Qwen3 q/k-norm+RoPE, x*scale+y (replacements counted "
                                                       "and logged; norm+quant: its own row)",
        modules=("pagedserve.compilation.pass_manager", "pagedserve.compilation.compiler_backend"),
        knobs=("compilation_config",),
        docs="docs/params-06-compilation.md",
        tests=("tests/compilation/test_graph_capture.py::test_fusion_flags_off_no_replacements_same_tokens",
               "tests/compilation/test_fusion_passes.py"),
    ),
    Feature(
        line="framework", family="weight loading", feature="safetensors load strategies (lazy mmap, eager "
                                                          "whole-file, prefetch read-ahead) and multithreaded "
                                                          "loading; bit-identical, TP slices read per rank; "
                                                          "loaded weights moved into one arena on transparent "
                                                          "huge pages on the CPU",
        modules=("pagedserve.model_loader.checkpoint_reader", "pagedserve.model_loader.load_strategies",
                 "pagedserve.config.load", "pagedserve.platforms.huge_page_weights"),
        knobs=("enable_multithread_load", "num_threads", "safetensors_load_strategy", "huge_page_weights"),
        docs="docs/params-06-weight-loading.md",
        tests=("tests/model_loader/test_load_strategies.py", "tests/platforms/test_huge_page_weights.py"),
    ),
    Feature(
        line="model", family="weight layout", feature="per-platform linear weight layout at load: bf16 weights "
                                                     "and LM head tile-packed for a native kernel on AMX "
                                                     "tiles, AVX512-BF16 dot products, or AVX-512 / AVX2 FMA "
                                                     "(amx_packed, auto in bfloat16 wherever the native kernels "
                                                     "are built; "
                                                     "prefill-sized MLPs run gate_up and SiLU-and-mul as one "
                                                     "bitwise-equal pass, and all-greedy steps take the argmax in "
                                                     "the LM head's epilogue without writing logits) or prepacked "
                                                     "for oneDNN, bit-exact unpack, "
                                                     "torch.compile-traceable; float32 decode batches on a "
                                                     "native streaming kernel (plain_native, auto in float32)",
        modules=("pagedserve.layers.weight_layout", "pagedserve.layers.linear", "pagedserve.layers.small_batch_linear",
                 "pagedserve.layers.amx_linear", "pagedserve.layers.amx_gate_up_silu",
                 "pagedserve.sample.fused_greedy_head"),
        knobs=("weight_layout",),
        docs="docs/params-06-weight-loading.md",
        tests=("tests/layers/test_weight_layout.py", "tests/layers/test_small_batch_linear.py",
               "tests/layers/test_amx_linear.py", "tests/layers/test_amx_gate_up_silu.py",
               "tests/sample/test_fused_greedy_head.py"),
    ),
    Feature(
        line="model", family="quantization", feature="GGUF weights kept quantized: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
                                                    "Q4_K, Q5_K and Q6_K linears, embedding and LM head computed on "
                                                    "their blocks (int16 activation dot products for every type, "
                                                    "the K-quants per 32-value sub-block; Q8_0/Q4_0/Q4_1/Q4_K on "
                                                    "AMX-INT8 tiles from 5 (Q4_K 9) rows and for prefill where the "
                                                    "CPU has them, dequantized tiles for the others' prefill; "
                                                    "Q8_0/Q4_0/Q4_1 interleaved 16 rows at a time at load where "
                                                    "the CPU has AVX2: the same bits on every unit and batch size), "
                                                    "a fused layer whose parts have different types (Q4_K_M's Q6_K "
                                                    "v beside Q4_K q, k) keeping each part's blocks, in the native "
                                                    "decode stack too; gguf_dequantize=True keeps the float path",
        modules=("pagedserve.layers.gguf_linear", "pagedserve.model_loader.gguf_quantized_load",
                 "pagedserve.models.native_decode_stack"),
        knobs=("gguf_dequantize",),
        docs="docs/quantization.md",
        tests=("tests/layers/test_gguf_linear.py", "tests/layers/test_gguf_interleaved.py",
               "tests/model_loader/test_gguf_kept_quantized.py",
               "tests/model_loader/test_gguf_decode_stack.py", "tests/accuracy/test_quantized_perplexity.py"),
    ),
    Feature(
        line="framework", family="batch invariance", feature="batch-invariant mode: bitwise-identical logits "
                                                            "alone or in any batch (fixed-tile GEMMs, fixed-order "
                                                            "paged attention, invariant reductions)",
        modules=("pagedserve.batch_invariant.step_mode", "pagedserve.batch_invariant.dispatch_mode",
                 "pagedserve.batch_invariant.matmul", "pagedserve.batch_invariant.attention"),
        knobs=("batch_invariant",),
        docs="docs/batch-invariance.md",
        tests=("tests/e2e/test_batch_invariance.py", "tests/batch_invariant/test_matmul.py",
               "tests/batch_invariant/test_attention.py"),
    ),
    Feature(
        line="framework", family="structured outputs", feature="structured outputs with xgrammar: JSON schema, "
                                                               "json_object, regex, choice and EBNF grammars "
                                                               "(SamplingParams.structured_outputs, OpenAI "
                                                               "response_format); grammars compiled once per "
                                                               "distinct constraint, off the engine loop; bitmask "
                                                               "on constrained rows only",
        modules=("pagedserve.structured_output.manager", "pagedserve.structured_output.grammar_compiler",
                 "pagedserve.structured_output.grammar_validation", "pagedserve.structured_output.logits_mask",
                 "pagedserve.structured_output.structured_outputs_params", "pagedserve.config.structured_outputs"),
        knobs=("structured_outputs_config",),
        docs="docs/structured-outputs.md",
        tests=("tests/structured_output/test_structured_outputs_default_model.py",
               "tests/structured_output/test_structured_outputs_grammar.py",
               "tests/structured_output/test_structured_outputs_equivalence.py",
               "tests/structured_output/test_structured_outputs_server.py",
               "tests/structured_output/test_structured_outputs_tensor_parallel.py"),
    ),
    Feature(
        line="framework", family="structured outputs", feature="reasoning parsers qwen3 and deepseek_r1: chat "
                                                               "answers carry reasoning_content apart from content "
                                                               "(streamed in its own deltas); structured outputs "
                                                               "apply after the reasoning ends",
        modules=("pagedserve.reasoning.reasoning_parser", "pagedserve.server.chat",
                 "pagedserve.structured_output.manager"),
        knobs=("reasoning_parser",),
        docs="docs/reasoning.md",
        tests=("tests/reasoning/test_reasoning_parser.py", "tests/reasoning/test_reasoning_server.py",
               "tests/structured_output/test_structured_outputs_grammar.py"),
    ),
    Feature(
        line="framework", family="structured outputs", feature="tool calling in the OpenAI server: tools and "
                                                               "tool_choice auto | none | required | a named "
                                                               "function; parsers hermes, qwen3, qwen3_coder, "
                                                               "llama3_json, deepseek_v3/v31 (whole and streamed); "
                                                               "required and named calls enforced by the grammar",
        modules=("pagedserve.tool_parsers.tool_parser", "pagedserve.tool_parsers.tool_parser_registry",
                 "pagedserve.tool_parsers.constrained_tool_calls", "pagedserve.server.tool_calling",
                 "pagedserve.server.chat_answer", "pagedserve.config.tool_calling"),
        knobs=(),
        docs="docs/tool-calling.md",
        tests=("tests/tool_parsers/test_tool_parsers.py", "tests/tool_parsers/test_tool_request.py",
               "tests/tool_parsers/test_tool_calling_server.py"),
    ),
    Feature(
        line="framework", family="spec decode", feature="speculative decoding framework with ngram prompt-lookup "
                                                        "and draft-model drafts (drafter KV in the target's blocks): "
                                                        "draft slots, verification in one forward, rollback, "
                                                        "batch-size table, vLLM's spec_decode metrics",
        modules=("pagedserve.config.speculative", "pagedserve.spec_decode.speculator",
                 "pagedserve.spec_decode.ngram_proposer", "pagedserve.spec_decode.draft_model_proposer",
                 "pagedserve.core.spec_decode_stats"),
        knobs=("speculative_config",),
        docs="docs/speculative-decoding.md",
        tests=("tests/spec_decode/test_ngram_speculation.py", "tests/spec_decode/test_ngram_proposer.py",
               "tests/spec_decode/test_draft_model_speculation.py", "tests/core/test_spec_decode_scheduling.py"),
    ),
    Feature(
        line="framework", family="spec decode", feature="EAGLE and EAGLE-3 drafters over the target's hidden states "
                                                        "(EAGLE-3: three target layers' inputs, draft-to-target vocab "
                                                        "map), from their published checkpoint layouts",
        modules=("pagedserve.spec_decode.hidden_state_proposer", "pagedserve.models.llama_eagle",
                 "pagedserve.models.llama_eagle3", "pagedserve.spec_decode.target_layer_capture",
                 "pagedserve.spec_decode.drafter_loading"),
        knobs=("speculative_config",),
        docs="docs/speculative-decoding.md",
        tests=("tests/spec_decode/test_hidden_state_speculation.py",),
    ),
    Feature(
        line="framework", family="spec decode", feature="MTP: DeepSeek-V3 / GLM-4.5 multi-token-prediction layers "
                                                        "from the target's checkpoint, run K times",
        modules=("pagedserve.models.multi_token_predictor", "pagedserve.spec_decode.hidden_state_proposer"),
        knobs=("speculative_config",),
        docs="docs/speculative-decoding.md",
        tests=("tests/spec_decode/test_hidden_state_speculation.py",),
    ),
    Feature(
        line="framework", family="spec decode", feature="DFlash block drafter: context KV from target layer "
                                                        "outputs, one non-causal block forward for K drafts, "
                                                        "top-probability confidence",
        modules=("pagedserve.models.qwen3_dflash", "pagedserve.layers.block_draft_attention",
                 "pagedserve.spec_decode.block_draft_proposer"),
        knobs=("speculative_config",),
        docs="docs/speculative-decoding.md",
        tests=("tests/spec_decode/test_block_draft_speculation.py",),
    ),
    Feature(
        line="framework", family="spec decode", feature="DSpark: DFlash block drafting plus the low-rank Markov head "
                                                        "(greedy) and the confidence head; dynamic per-request "
                                                        "verify budgets (dynamic_spec_config)",
        modules=("pagedserve.models.qwen3_dspark", "pagedserve.spec_decode.dynamic_spec_scheduler",
                 "pagedserve.spec_decode.block_draft_proposer"),
        knobs=("speculative_config",),
        docs="docs/speculative-decoding.md",
        tests=("tests/spec_decode/test_block_draft_speculation.py", "tests/spec_decode/test_dynamic_spec_scheduler.py"),
    ),
    Feature(
        line="framework", family="spec decode", feature="rejection sampler: greedy, standard (lossless), block "
                                                        "verify (lossless), entropy verify (lossy)",
        modules=("pagedserve.spec_decode.rejection_sampler",),
        knobs=("speculative_config",),
        docs="docs/speculative-decoding.md",
        tests=("tests/spec_decode/test_rejection_sampler.py",),
    ),
    Feature(
        line="framework", family="PD disaggregation", feature="KV connector seam (vLLM v1's scheduler / worker "
                                                              "split, WAITING_FOR_REMOTE_KVS, held blocks) and "
                                                              "MultiConnector",
        modules=("pagedserve.kv_transfer.connector_base", "pagedserve.kv_transfer.connector_factory",
                 "pagedserve.kv_transfer.multi_connector", "pagedserve.config.kv_transfer"),
        knobs=("kv_transfer_config",),
        docs="docs/kv_transfer.md",
        tests=("tests/core/test_scheduler_kv_connector.py", "tests/kv_transfer/test_kv_transfer_config.py",
               "tests/kv_transfer/test_pull_connector.py::test_consumer_uses_the_producers_bytes"),
    ),
    Feature(
        line="framework", family="PD disaggregation", feature="PullConnector: D pulls P's KV blocks over ZeroMQ "
                                                              "or Mooncake's Transfer Engine "
                                                              "(handshake checks, P frees on done or timeout, "
                                                              "kv_load_failure_policy recompute | fail); dense and "
                                                              "MLA models",
        modules=("pagedserve.kv_transfer.pull_connector_scheduler", "pagedserve.kv_transfer.pull_connector_worker",
                 "pagedserve.kv_transfer.zmq_block_transport", "pagedserve.kv_transfer.mooncake_block_transport",
                 "pagedserve.kv_transfer.kv_page_regions",
                 "pagedserve.kv_transfer.kv_transfer_params"),
        knobs=("kv_transfer_config", "extra_args"),
        docs="docs/kv_transfer.md",
        tests=("tests/kv_transfer/test_pull_connector.py", "tests/kv_transfer/test_kv_page_regions.py",
               "tests/kv_transfer/test_mooncake_transport.py"),
    ),
    Feature(
        line="framework", family="PD disaggregation", feature="PullConnector with data parallel P and D: each DP "
                                                              "rank its own connector, engine id "
                                                              "<engine_id>_dp<rank> and ports kv_port + rank offset; "
                                                              "pull: P's answer names the rank holding the blocks; "
                                                              "push: P's rank is a hash of the request id the proxy "
                                                              "names to D; /kv_transfer_info lists every rank",
        modules=("pagedserve.engine.dp_engine_core", "pagedserve.config.kv_transfer",
                 "pagedserve.kv_transfer.kv_transfer_info", "pagedserve.kv_transfer.push_producer_rank"),
        knobs=("kv_transfer_config", "data_parallel_size"),
        docs="docs/kv_transfer.md",
        tests=("tests/kv_transfer/test_pull_connector_data_parallel.py",
               "tests/kv_transfer/test_kv_transfer_config.py::test_data_parallel_ranks_derive_engine_ids_and_ports",
               "tests/kv_transfer/test_kv_transfer_config.py::test_data_parallel_refusals",
               "tests/kv_transfer/test_push_connector.py::test_push_with_two_data_parallel_ranks_on_both_sides"),
    ),
    Feature(
        line="framework", family="PD disaggregation", feature="PullConnector layer-wise push mode: D reserves its "
                                                              "blocks and sends P a push order, P sends each layer's "
                                                              "KV from save_kv_layer as its forward writes it (zmq, "
                                                              "one rank a side; dense, MLA and DSA)",
        modules=("pagedserve.kv_transfer.push_connector_scheduler", "pagedserve.kv_transfer.push_connector_worker",
                 "pagedserve.attention.forward_context"),
        knobs=("kv_transfer_config",),
        docs="docs/kv_transfer.md",
        tests=("tests/kv_transfer/test_push_connector.py",),
    ),
    Feature(
        line="framework", family="pooling", feature="PoolConnector: full KV blocks shared by engines through a store "
                                                    "(Mooncake Store or Redis / Valkey) or a local tier (host "
                                                    "memory, then disk), looked up by chained block hash after the "
                                                    "local prefix hit, checksummed, stored asynchronously; serves on "
                                                    "without a pool that is down",
        modules=("pagedserve.kv_transfer.pool_connector_scheduler", "pagedserve.kv_transfer.pool_connector_worker",
                 "pagedserve.kv_transfer.pool_store", "pagedserve.kv_transfer.pool_store_connection",
                 "pagedserve.kv_transfer.redis_pool_store", "pagedserve.kv_transfer.mooncake_pool_store",
                 "pagedserve.kv_transfer.local_pool_store",
                 "pagedserve.kv_transfer.pool_block_format", "pagedserve.config.kv_pool"),
        knobs=("kv_transfer_config",),
        docs="docs/kv_pool.md",
        tests=("tests/kv_transfer/test_pool_connector.py", "tests/kv_transfer/test_pool_block_format.py",
               "tests/core/test_scheduler_kv_pool.py", "tests/kv_transfer/test_local_pool_store.py"),
    ),
    Feature(
        line="framework", family="PD disaggregation", feature="PD over several worker ranks ('mp'): kv pp (P with "
                                                              "pipeline parallel, each layer from the stage holding "
                                                              "it) and unequal TP (either TP a multiple of the "
                                                              "other, head-interval mapping: D with fewer ranks "
                                                              "gathers heads, D with more ranks slices them; MLA "
                                                              "read whole from one rank)",
        modules=("pagedserve.kv_transfer.kv_pull_plan", "pagedserve.kv_transfer.kv_output_aggregator"),
        knobs=("kv_transfer_config", "tensor_parallel_size", "pipeline_parallel_size"),
        docs="docs/kv_transfer.md",
        tests=("tests/kv_transfer/test_pull_connector_parallel.py", "tests/kv_transfer/test_kv_pull_plan.py"),
    ),
    Feature(
        line="framework", family="PD disaggregation", feature="KV connectors with async scheduling (P, D and the "
                                                              "pool schedule one step ahead) and with speculative "
                                                              "decoding on D (ngram; draft_model, whose KV D "
                                                              "recomputes over the pulled prompt; EAGLE / EAGLE-3 / "
                                                              "MTP, whose drafter pages travel beside the target's)",
        modules=("pagedserve.config.kv_transfer", "pagedserve.kv_transfer.connector_factory"),
        knobs=("kv_transfer_config", "async_scheduling", "speculative_config"),
        docs="docs/kv_transfer.md",
        tests=("tests/kv_transfer/test_connector_with_engine_features.py",),
    ),
    Feature(
        line="framework", family="PD disaggregation", feature="`pagedserve proxy`: OpenAI front over P and D servers "
                                                              "in pull mode or push mode (--kv-transfer-mode: D and "
                                                              "P at once under one request id, P's block server "
                                                              "from its /kv_transfer_info; each instance's role and "
                                                              "mode checked at start), kv_transfer_params and "
                                                              "caller-chosen request ids (X-Request-Id, request_id) "
                                                              "through the server, least-loaded choice, streaming, "
                                                              "per-instance /metrics, a dead instance fails only its "
                                                              "requests",
        modules=("pagedserve.proxy.pd_proxy", "pagedserve.proxy.instance_pool", "pagedserve.proxy.proxy_metrics",
                 "pagedserve.proxy.kv_transfer_mode", "pagedserve.kv_transfer.kv_transfer_info",
                 "pagedserve.server.protocol", "pagedserve.server.request_ids"),
        knobs=("kv_transfer_config",),
        docs="docs/kv_transfer.md",
        tests=("tests/proxy/test_pd_proxy.py", "tests/proxy/test_pd_proxy_push.py"),
    ),
    Feature(
        line="framework", family="PD disaggregation", feature="P/D ratio tuning: `pagedserve bench pd` measures "
                                                              "prefill and decode capacity, recommends the xPyD "
                                                              "split under TTFT / TPOT SLOs, sweeps real splits",
        modules=("pagedserve.bench.pd", "pagedserve.bench.pd_split", "pagedserve.bench.pd_capacity",
                 "pagedserve.bench.pd_sweep"),
        knobs=(),
        docs="docs/kv_transfer.md",
        tests=("tests/bench/test_pd_split.py", "tests/bench/test_bench_pd.py::test_bench_pd_measures_and_recommends"),
    ),
)


def render_markdown() -> str:
    lines = [
        "# Features",
        "",
        "Generated from `pagedserve/features.py` by `pagedserve features --markdown`; "
        "a row is listed only when the feature works and is tested.",
        "",
        "| line | family | feature | knobs | docs | tests |",
        "|---|---|---|---|---|---|",
    ]
    for f in FEATURES:
        knobs = ", ".join(f"`{k}`" for k in f.knobs) or "-"
        tests = "<br>".join(f"`{t}`" for t in f.tests)
        lines.append(f"| {f.line} | {f.family} | {f.feature} | {knobs} | [{f.docs}]({f.docs.removeprefix('docs/')}) "
                     f"| {tests} |")
    return "\n".join(lines) + "\n"
