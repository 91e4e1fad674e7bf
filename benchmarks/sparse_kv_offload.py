"""Sparse KV offload against the all-resident cache: one long-context request on a random DeepSeek-V3.2-shaped
model (issue #31, part 4).

The model is the tests' tiny DeepSeek-V3.2 (tests/tiny_models.py) widened to kv_lora_rank 128, rope 32,
index_topk 256, 8 index heads of 64 dims, 2 layers (one dense MLP, one MoE), built offline into the pagedserve
benchmark-model cache. One prompt of `--prompt-len` random token ids is prefilled in chunks of
`--max-num-batched-tokens`, then `--output-len` greedy tokens are decoded (ignore_eos). Run once all-resident and
once with `sparse_kv_offload={"num_resident_blocks": N}`, N = `--resident-fraction` (default 10%) of the request's
KV blocks. Prints prefill seconds, decode tokens/s, the offload counters (block hits, misses, blocks moved in,
multi-round gathers), the tier file's size, and whether the greedy tokens are identical; beside the wall times the
process's CPU seconds (prefill; decode tokens per CPU second) and the load average at each engine's start and end.

    python benchmarks/sparse_kv_offload.py --prompt-len 8192 --output-len 64
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from cpu_kind import result_path, write_result_file  # noqa: E402
import native_guard  # noqa: E402

MODEL_SHAPE = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=128, qk_rope_head_dim=32,
                   qk_nope_head_dim=32, v_head_dim=32, index_topk=256, index_head_dim=64, index_n_heads=8,
                   max_position_embeddings=131072)


def model_folder() -> str:
    """Build (once) and return the benchmark DSA model's folder."""
    from tiny_models import build_tiny_model

    from pagedserve.cache_directory import cache_root

    folder = os.path.join(cache_root(), "benchmark-models", "random-deepseek-v32-offload")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        os.makedirs(folder, exist_ok=True)
        build_tiny_model("deepseek-v32", folder, **MODEL_SHAPE)
    return folder


def run(folder: str, prompt: list[int], output_len: int, dtype: str, block_size: int, max_num_batched_tokens: int,
        num_cpu_threads: int, sparse_kv_offload: dict | None) -> dict:
    from pagedserve import LLM, SamplingParams

    num_blocks = math.ceil((len(prompt) + output_len) / block_size) + 2
    llm = LLM(folder, dtype=dtype, max_model_len=len(prompt) + output_len, num_kv_blocks=num_blocks,
              block_size=block_size, max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False,
              max_num_seqs=1, num_cpu_threads=num_cpu_threads, sparse_kv_offload=sparse_kv_offload)
    engine = llm.llm_engine
    # Warm-up (first-call costs of the process and the engine), then reset the offload counters' baseline.
    llm.generate([{"prompt_token_ids": prompt[:64]}], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    before = engine.engine_core.make_stats().sparse_kv_offload
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    engine.add_request("0", {"prompt_token_ids": prompt}, params)
    load_start = os.getloadavg()[0]
    # The engine runs in this process (one torch thread): its CPU seconds are the work, steadier than the wall time
    # on a machine shared with other jobs.
    start, cpu_start = time.perf_counter(), time.process_time()
    tokens: list[int] = []
    first_token_at = first_token_cpu = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens = list(output.outputs[0].token_ids)
        if tokens and first_token_at is None:
            first_token_at, first_token_cpu = time.perf_counter(), time.process_time()
    end, cpu_end = time.perf_counter(), time.process_time()
    stats = engine.engine_core.make_stats().sparse_kv_offload
    offload = engine.engine_core.executor.worker.kv_offload
    tier_bytes = offload.tier.num_bytes if offload is not None else 0
    engine.shutdown()
    assert len(tokens) == output_len and first_token_at is not None
    result = {"offload": sparse_kv_offload, "prompt_len": len(prompt), "output_len": output_len,
              "num_kv_blocks": num_blocks, "prefill_s": first_token_at - start,
              "decode_tokens_per_s": (output_len - 1) / (end - first_token_at), "tier_bytes": tier_bytes,
              "prefill_cpu_s": first_token_cpu - cpu_start,
              "decode_tokens_per_cpu_s": (output_len - 1) / (cpu_end - first_token_cpu),
              "load_average_1min_start": load_start, "load_average_1min_end": os.getloadavg()[0], "tokens": tokens}
    if stats is not None:
        counters = {name: getattr(stats, f"num_{name}") - getattr(before, f"num_{name}")
                    for name in ("block_hits", "block_misses", "blocks_moved_in", "blocks_evicted",
                                 "multi_round_gathers")}
        lookups = counters["block_hits"] + counters["block_misses"]
        result.update(counters, hit_rate=counters["block_hits"] / lookups if lookups else 0.0)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--resident-fraction", type=float, default=0.1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-cpu-threads", type=int, default=1,
                        help="torch threads (default 1: on a 2-core machine shared with other work, two spinning "
                             "OpenMP threads made decode steps ~30x slower)")
    parser.add_argument("--tier-directory", default=None, help="where the tier file goes (default: the temp dir)")
    parser.add_argument("--json-out", default=None, help="default results/sparse_kv_offload_<dtype>_<cpu kind>.json; "
                                                         "'' for none")
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_kernels = native_guard.require_native_kernels(args.allow_plain_pytorch)
    torch.set_num_threads(args.num_cpu_threads)
    folder = model_folder()
    rng = random.Random(0)
    prompt = [rng.randrange(8, 600) for _ in range(args.prompt_len)]
    num_request_blocks = math.ceil((args.prompt_len + args.output_len) / args.block_size)
    num_resident = max(1, round(args.resident_fraction * num_request_blocks))
    offload = {"num_resident_blocks": num_resident, "tier_directory": args.tier_directory or tempfile.gettempdir()}
    results = [run(folder, prompt, args.output_len, args.dtype, args.block_size, args.max_num_batched_tokens,
                   args.num_cpu_threads, config) for config in (None, offload)]
    resident, offloaded = results
    for result in results:
        name = "all-resident" if result["offload"] is None else f"offload {num_resident} blocks"
        line = (f"{name:<20} prefill {result['prefill_s']:7.1f} s (CPU {result['prefill_cpu_s']:6.1f} s)  decode "
                f"{result['decode_tokens_per_s']:6.2f} tok/s ({result['decode_tokens_per_cpu_s']:6.2f} per CPU s)  load "
                f"{result['load_average_1min_start']:.1f} / {result['load_average_1min_end']:.1f}")
        if result["offload"] is not None:
            line += (f"  hits {result['block_hits']} misses {result['block_misses']} moved in "
                     f"{result['blocks_moved_in']} (hit rate {result['hit_rate']:.1%}), multi-round gathers "
                     f"{result['multi_round_gathers']}, tier {result['tier_bytes'] / 2**20:.1f} MiB")
        print(line)
    same = resident["tokens"] == offloaded["tokens"]
    print(f"request blocks {num_request_blocks}, resident {num_resident} per layer; identical greedy tokens: {same}; "
          f"decode offload / resident {offloaded['decode_tokens_per_s'] / resident['decode_tokens_per_s']:.2f}x")
    json_out = result_path("sparse_kv_offload", args.dtype) if args.json_out is None else args.json_out
    if json_out:
        for result in results:
            result.pop("tokens")
        write_result_file({"native_kernels": native_kernels, "results": results, "identical_tokens": same,
                           "num_resident_blocks": num_resident,
                           "num_request_blocks": num_request_blocks}, json_out)


if __name__ == "__main__":
    main()
