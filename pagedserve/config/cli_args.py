"""Engine flags for the command line: one flag per EngineConfig.create keyword, same names."""
from __future__ import annotations

import argparse
from typing import Any

from pagedserve.config.load import WEIGHT_LAYOUTS
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output.structured_outputs_params import StructuredOutputsParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="HF model folder, .gguf file, or 'smollm2-135m-instruct' (the default)")
    group.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-num-batched-tokens", type=int, default=None)
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--kv-cache-memory", default=None, help="bytes or a size such as '2GiB'")
    group.add_argument("--num-kv-blocks", type=int, default=None)
    group.add_argument("--kv-cache-dtype", default="auto",
                       help="'auto' (the model's dtype) or 'int8' (per-token-per-head scales; ~2x the tokens)")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
                       help="schedule step t+1 while step t executes (less idle time between steps)")
    parallel = parser.add_argument_group("parallel")
    parallel.add_argument("--tensor-parallel-size", type=int, default=1)
    parallel.add_argument("--pipeline-parallel-size", type=int, default=1)
    parallel.add_argument("--data-parallel-size", type=int, default=1)
    parallel.add_argument("--enable-expert-parallel", action=argparse.BooleanOptionalAction, default=False)
    parallel.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"])
    parallel.add_argument("--lmhead-tensor-parallel-size", type=int, default=0,
                          help="LM head TP degree, dividing --tensor-parallel-size (0: same)")
    parallel.add_argument("--embedding-tensor-parallel-size", type=int, default=0,
                          help="word embedding TP degree, dividing --tensor-parallel-size (0: same)")
    parallel.add_argument("--oproj-tensor-parallel-size", type=int, default=0,
                          help="attention o_proj TP degree, dividing --tensor-parallel-size (0: same)")
    parallel.add_argument("--enable-reduce-sample", action=argparse.BooleanOptionalAction, default=False)
    parallel.add_argument("--enable-sequence-parallel", action=argparse.BooleanOptionalAction, default=False,
                          help="split the residual stream by tokens over the TP ranks (reduce-scatter / all-gather "
                               "instead of all-reduce around the norms)")
    parallel.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1,
                          help="split each request's KV history over this many consecutive TP ranks (divides "
                               "--tensor-parallel-size; attention merged by log-sum-exp)")
    parallel.add_argument("--prefill-context-parallel-size", "-pcp", type=int, default=1,
                          help="add this many copies of the TP x PP ranks that split each step's tokens; the KV "
                               "positions are split over them too (with -dcp over pcp x dcp ranks)")
    parallel.add_argument("--enable-balance-scheduling", action=argparse.BooleanOptionalAction, default=False)
    parallel.add_argument("--dyntra-lb-config", default=None,
                          help='JSON object, e.g. \'{"enabled": true, "bubble_threshold": 4}\'')
    moe = parser.add_argument_group("moe")
    moe.add_argument("--eplb-config", default=None,
                     help='EPLB as a JSON object, e.g. \'{"enable": true, "step_interval": 600, '
                          '"num_redundant_experts": 2, "policy": "flashlb"}\'')
    moe.add_argument("--multistream-overlap-shared-expert", action=argparse.BooleanOptionalAction, default=False,
                     help="run MoE shared experts on a second device stream (no effect on the CPU)")
    group.add_argument("--num-cpu-threads", type=int, default=None,
                       help="torch threads of the engine (default: every core; `serve` leaves one core "
                            "to the HTTP front end on machines of 4 or more cores)")
    execution = parser.add_argument_group("execution")
    execution.add_argument("--enable-cpu-binding", action=argparse.BooleanOptionalAction, default=False,
                           help="pin each worker and its torch threads to distinct physical cores (NUMA-aware)")
    execution.add_argument("--profiling-chunk-config", default=None,
                           help='profiling-tuned prefill chunks as a JSON object, e.g. '
                                '\'{"enable": true, "target_tpot_ms": 50}\'')
    execution.add_argument("--compilation-config", default=None,
                           help='graph capture as a JSON object, e.g. \'{"mode": "compile", '
                                '"cudagraph_capture_sizes": [1, 2, 4, 8], "fuse_norm_quant": true}\'')
    execution.add_argument("--attention-backend", default=None, choices=["torch_paged", "cpu_native"],
                           help="paged attention backend (default: the platform's; on the CPU 'cpu_native' "
                                "when its C++ kernels build, else 'torch_paged')")
    execution.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                           help="never capture/compile the model forward (overrides compilation_config.mode)")
    execution.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=False,
                           help="bitwise-identical logits for a request whatever else is in the batch "
                                "(slower; also VLLM_BATCH_INVARIANT=1)")
    execution.add_argument("--native-decode-stack", action=argparse.BooleanOptionalAction, default=True,
                           help="run decode-only steps of Llama-family models on the CPU in one native call "
                                "(on by default where the model qualifies; --no-native-decode-stack: the modules)")
    speculative = parser.add_argument_group("speculative decoding")
    speculative.add_argument("--speculative-config", default=None,
                             help='speculative decoding as a JSON object, e.g. \'{"method": "ngram", '
                                  '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\'')
    execution.add_argument("--sparse-kv-offload", default=None,
                           help='sparse KV offload of DeepSeek sparse-attention models as a JSON object, e.g. '
                                '\'{"num_resident_blocks": 64, "tier_directory": "/mnt/scratch"}\'')
    kv_transfer = parser.add_argument_group("KV transfer (prefill/decode disaggregation)")
    kv_transfer.add_argument("--kv-transfer-config", default=None,
                             help='the KV connector as a JSON object, e.g. \'{"kv_connector": "PullConnector", '
                                  '"kv_role": "kv_producer", "kv_port": 5600}\' (docs/kv_transfer.md)')
    structured = parser.add_argument_group("structured outputs")
    structured.add_argument("--structured-outputs-config", default=None,
                            help='the grammar engine of structured outputs as a JSON object, e.g. \'{"backend": '
                                 '"xgrammar", "num_compile_threads": 1, "grammar_cache_size": 256}\'')
    structured.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                            help="the reasoning model's parser: chat answers carry reasoning_content apart from "
                                 "content, and structured outputs apply after the reasoning")
    add_load_args(parser)


def add_load_args(parser: argparse.ArgumentParser) -> None:
    """Checkpoint loading and the weight layout (config/load.py)."""
    load = parser.add_argument_group("load")
    load.add_argument("--enable-multithread-load", action=argparse.BooleanOptionalAction, default=False,
                      help="read checkpoint tensors in a pool of --num-threads threads")
    load.add_argument("--num-threads", type=int, default=8, help="threads of --enable-multithread-load (8)")
    load.add_argument("--safetensors-load-strategy", default="lazy", choices=["lazy", "eager", "prefetch"],
                      help="lazy: memory-mapped reads on demand; eager: whole files read first; prefetch: lazy "
                           "with the next shard files read ahead")
    load.add_argument("--weight-layout", default="auto", choices=list(WEIGHT_LAYOUTS),
                      help="linear weight layout after loading (prepacked: the platform GEMM's packed layout; "
                           "plain_native: plain float32 weights, decode batches on a native CPU kernel; "
                           "amx_packed: bfloat16 weights tile-packed for the native AMX / AVX512-BF16 kernel; "
                           "auto: whichever was measured faster for the platform and dtype)")
    load.add_argument("--huge-page-weights", action=argparse.BooleanOptionalAction, default=True,
                      help="move the loaded weights into one arena on transparent huge pages (CPU; faster "
                           "weight streaming in decode); --no-huge-page-weights keeps them where loading put them")
    load.add_argument("--gguf-dequantize", action=argparse.BooleanOptionalAction, default=False,
                      help="dequantize a .gguf file's weights to the model dtype at load (default: keep the "
                           "quantized blocks and compute on them)")


def load_engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    names = ("enable_multithread_load", "num_threads", "safetensors_load_strategy", "weight_layout",
             "huge_page_weights", "gguf_dequantize")
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def moe_engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return dict(eplb_config=getattr(args, "eplb_config", None),
                multistream_overlap_shared_expert=getattr(args, "multistream_overlap_shared_expert", False))


def parallel_engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The parallel group's flags as EngineConfig.create keywords (same names)."""
    names = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "enable_expert_parallel",
             "distributed_executor_backend", "lmhead_tensor_parallel_size", "embedding_tensor_parallel_size",
             "oproj_tensor_parallel_size", "enable_reduce_sample", "enable_balance_scheduling", "dyntra_lb_config",
             "decode_context_parallel_size", "prefill_context_parallel_size", "enable_sequence_parallel")
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def execution_engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return dict(enable_cpu_binding=getattr(args, "enable_cpu_binding", False),
                profiling_chunk_config=getattr(args, "profiling_chunk_config", None),
                compilation_config=getattr(args, "compilation_config", None),
                enforce_eager=getattr(args, "enforce_eager", False),
                attention_backend=getattr(args, "attention_backend", None),
                batch_invariant=getattr(args, "batch_invariant", False),
                native_decode_stack=getattr(args, "native_decode_stack", True),
                speculative_config=getattr(args, "speculative_config", None),
                sparse_kv_offload=getattr(args, "sparse_kv_offload", None),
                kv_transfer_config=getattr(args, "kv_transfer_config", None),
                structured_outputs_config=getattr(args, "structured_outputs_config", None),
                reasoning_parser=getattr(args, "reasoning_parser", None))


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return execution_engine_kwargs_from_args(args) | moe_engine_kwargs_from_args(args) | \
        parallel_engine_kwargs_from_args(args) | load_engine_kwargs_from_args(args) | dict(
        model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill, enable_prefix_caching=args.enable_prefix_caching,
        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        seed=args.seed, scheduling_policy=args.scheduling_policy, num_cpu_threads=args.num_cpu_threads,
        async_scheduling=getattr(args, "async_scheduling", False),
    )


def add_sampling_args(parser: argparse.ArgumentParser, default_max_tokens: int = 16) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=default_max_tokens)
    group.add_argument("--temperature", type=float, default=1.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=-1)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")
    group.add_argument("--logprobs", type=int, default=None)
    structured = group.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", default=None, metavar="SCHEMA",
                            help="answer with JSON matching this JSON schema (JSON text, or @FILE)")
    structured.add_argument("--regex", default=None, help="answer with text matching this regular expression")
    structured.add_argument("--choice", action="append", default=None, help="answer with one of these (repeatable)")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, seed=args.sampling_seed, stop=args.stop,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs, structured_outputs=_structured_outputs_from_args(args),
    )


def _structured_outputs_from_args(args: argparse.Namespace) -> StructuredOutputsParams | None:
    """--json-schema / --regex / --choice as a constraint (None when none is given)."""
    schema = getattr(args, "json_schema", None)
    if schema is not None:
        if schema.startswith("@"):
            with open(schema[1:]) as f:
                schema = f.read()
        return StructuredOutputsParams(json=schema)
    if getattr(args, "regex", None) is not None:
        return StructuredOutputsParams(regex=args.regex)
    if getattr(args, "choice", None):
        return StructuredOutputsParams(choice=args.choice)
    return None
