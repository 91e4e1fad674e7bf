"""int8 KV cache against the model-dtype cache: capacity in tokens, and throughput where the latter runs short.

Workload (issue #30, part 4): 64 requests, prompts uniform in [1000, 2000] random token ids, `--output-len`
greedy tokens each (ignore_eos), seed 0, on the random Llama of SmolLM2-135M's shape (benchmark_model.py). Both
engines get the same `--kv-cache-memory` bytes of KV cache, by default a third of what the whole workload needs
in the model's dtype, so the "auto" cache cannot hold every request at once (the scheduler admits fewer, and a
request whose next block is missing preempts another) while the int8 cache holds about twice the tokens. Prints,
per kv_cache_dtype: blocks, capacity in tokens, wall seconds, output and total tokens/s, preemptions.

    python benchmarks/kv_cache_int8.py --dtype bfloat16 [--num-requests 64] [--output-len 64]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_model import benchmark_model_folder  # noqa: E402
from cpu_kind import result_path, write_result_file  # noqa: E402
import native_guard  # noqa: E402
from offline_throughput import make_workload  # noqa: E402

VOCAB_SIZE = 49152


def kv_bytes_per_token(folder: str, dtype: str) -> int:
    """The model-dtype cache's bytes per token over all layers (from the model's config)."""
    import json

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    element_size = {"bfloat16": 2, "float32": 4}[dtype]
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * element_size


def run(folder: str, workload, dtype: str, kv_cache_dtype: str, kv_cache_memory: int,
        max_num_batched_tokens: int) -> dict:
    from pagedserve import LLM, SamplingParams

    llm = LLM(folder, dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=kv_cache_memory,
              max_model_len=4096, max_num_seqs=len(workload), max_num_batched_tokens=max_num_batched_tokens,
              enable_prefix_caching=False)
    core = llm.llm_engine.engine_core
    info = core.runtime_info
    block_size = llm.config.cache_config.block_size
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in workload]
    llm.generate(prompts[:1], [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)], use_tqdm=False)
    preemptions_before = core.make_stats().num_preemptions
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_prompt = sum(len(p) for p, _ in workload)
    assert num_output == sum(n for _, n in workload)
    return {"kv_cache_dtype": kv_cache_dtype, "dtype": dtype, "kv_cache_memory": kv_cache_memory,
            "num_kv_blocks": info.num_kv_blocks, "capacity_tokens": (info.num_kv_blocks - 1) * block_size,
            "kv_cache_bytes": info.kv_cache_bytes, "seconds": seconds, "output_tokens": num_output,
            "prompt_tokens": num_prompt, "output_tokens_per_s": num_output / seconds,
            "total_tokens_per_s": (num_output + num_prompt) / seconds,
            "num_preemptions": core.make_stats().num_preemptions - preemptions_before,
            "outputs": [list(o.outputs[0].token_ids) for o in outputs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(1000, 2000))
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kv-cache-memory", type=int, default=None,
                        help="bytes for both caches (default: a third of what the workload needs in --dtype)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", default=None, help="default results/kv_cache_int8_<dtype>_<cpu kind>.json; "
                                                         "'' for none")
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_kernels = native_guard.require_native_kernels(args.allow_plain_pytorch)
    torch.set_num_threads(os.cpu_count() or 2)
    folder = benchmark_model_folder()
    workload = make_workload(args.num_requests, args.seed, VOCAB_SIZE, tuple(args.prompt_range),
                             (args.output_len, args.output_len))
    needed_tokens = sum(len(p) + n for p, n in workload)
    kv_cache_memory = args.kv_cache_memory or needed_tokens * kv_bytes_per_token(folder, args.dtype) // 3
    results = [run(folder, workload, args.dtype, kv_cache_dtype, kv_cache_memory, args.max_num_batched_tokens)
               for kv_cache_dtype in ("auto", "int8")]
    print(f"workload: {args.num_requests} requests, {needed_tokens} tokens in all; KV cache {kv_cache_memory} bytes")
    for result in results:
        print(f"{result['kv_cache_dtype']:<5} {result['num_kv_blocks']:>6} blocks {result['capacity_tokens']:>7} tokens "
              f"{result['seconds']:>8.1f} s {result['output_tokens_per_s']:>7.1f} out tok/s "
              f"{result['total_tokens_per_s']:>8.1f} total tok/s {result['num_preemptions']:>4} preemptions")
    auto, int8 = results
    same = sum(a == b for a, b in zip(auto["outputs"], int8["outputs"]))
    print(f"int8 / auto: capacity {int8['capacity_tokens'] / auto['capacity_tokens']:.2f}x, throughput "
          f"{int8['total_tokens_per_s'] / auto['total_tokens_per_s']:.2f}x; identical greedy outputs {same}/"
          f"{len(workload)}")
    json_out = result_path("kv_cache_int8", args.dtype) if args.json_out is None else args.json_out
    if json_out:
        for result in results:
            result.pop("outputs")
        write_result_file({"native_kernels": native_kernels, "results": results, "identical_outputs": same,
                           "num_requests": args.num_requests,
                           "prompt_range": list(args.prompt_range), "output_len": args.output_len}, json_out)


if __name__ == "__main__":
    main()
