"""Weight loading strategies and the prepacked weight layout, on the SmolLM2-shaped random Llama.

Three parts (each can be skipped):
1. load: load time and peak RSS per safetensors_load_strategy (lazy / eager / prefetch) x threads (1 / 2),
   each in a fresh subprocess, on the sharded copy of the benchmark model (5 shards of <= 128 MiB, float32
   on disk, loaded as --dtype), with the page cache warm (files read just before) and cold (the files'
   pages dropped with posix_fadvise(DONTNEED) before the child starts). Load time = building the model
   and loading every tensor (load_model), peak RSS = the child's ru_maxrss minus its RSS before loading.
2. gemm: plain F.linear vs oneDNN prepacked (mkldnn._linear_pointwise on a _reorder_linear_weight'd
   weight) for the model's linear shapes at M = 1, 16, 64, 256, in bfloat16 and float32 (--threads, 2);
   variants interleaved round by round; the best round per call is reported (the least disturbed by
   other processes on a shared machine).
3. decode: decode step time with weight_layout='plain' vs 'prepacked' (eager forward), batch 1 and 16,
   32-token prompts: (time of 65 output tokens - time of 1) / 64.

    python benchmarks/weight_loading.py [--dtype bfloat16] [--parts load,gemm,decode] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import native_guard

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # benchmark_model, and pagedserve from this checkout

LINEAR_SHAPES = {  # (out, in) of SmolLM2-135M's linear layers (+ the tied LM head, for reference)
    "qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- 1. load ------------------------------------------------------------------------------------
def child_load(folder: str, strategy: str, num_threads: int, dtype_name: str) -> dict:
    import torch
    from transformers import AutoConfig

    from pagedserve.config.load import LoadConfig
    from pagedserve.config.model import ModelConfig
    from pagedserve.model_loader import load_model

    torch.set_num_threads(2)
    dtype = getattr(torch, dtype_name)
    config = ModelConfig(model=folder, hf_config=AutoConfig.from_pretrained(folder, local_files_only=True), dtype=dtype)
    load_config = LoadConfig(enable_multithread_load=num_threads > 1, num_threads=num_threads,
                             safetensors_load_strategy=strategy, weight_layout="plain")
    rss_before = _rss_bytes()
    started = time.perf_counter()
    model = load_model(config, "cpu", load_config=load_config)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"seconds": seconds, "peak_rss_delta_mib": (peak - rss_before) / 2**20,
            "param_mib": param_bytes / 2**20}


def _page_cache(folder: str, warm: bool) -> None:
    for name in os.listdir(folder):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(folder, name), "rb", buffering=0) as f:
            if warm:
                while f.read(16 << 20):
                    pass
            else:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def bench_load(dtype: str, repeats: int) -> list[str]:
    from benchmark_model import sharded_benchmark_model_folder

    folder = sharded_benchmark_model_folder()
    num_files = sum(name.endswith(".safetensors") for name in os.listdir(folder))
    lines = [f"## load: {folder} ({num_files} shards), dtype {dtype}, median of {repeats} fresh processes", "",
             "| cache | strategy | threads | load s | vs lazy/1 | peak RSS delta MiB | params MiB |",
             "|---|---|---|---|---|---|---|"]
    configs = [(cache, strategy, num_threads) for cache in ("warm", "cold")
               for strategy in ("lazy", "eager", "prefetch") for num_threads in (1, 2)]
    runs: dict[tuple, list[dict]] = {config: [] for config in configs}
    for _ in range(repeats):  # round-robin, so a change in machine load hits every config alike
        for config in configs:
            cache, strategy, num_threads = config
            _page_cache(folder, warm=cache == "warm")
            output = subprocess.run(
                [sys.executable, __file__, "--child-load", json.dumps([folder, strategy, num_threads, dtype])],
                check=True, capture_output=True, text=True).stdout
            runs[config].append(json.loads(output.strip().splitlines()[-1]))
    baselines = {cache: statistics.median(r["seconds"] for r in runs[(cache, "lazy", 1)]) for cache in ("warm", "cold")}
    for config in configs:
        cache, strategy, num_threads = config
        seconds = statistics.median(r["seconds"] for r in runs[config])
        rss = statistics.median(r["peak_rss_delta_mib"] for r in runs[config])
        lines.append(f"| {cache} | {strategy} | {num_threads} | {seconds:.3f} | {baselines[cache] / seconds:.2f}x | "
                     f"{rss:.0f} | {runs[config][0]['param_mib']:.0f} |")
        print(lines[-1], flush=True)
    return lines


# ---- 2. gemm ------------------------------------------------------------------------------------
def bench_gemm(num_threads: int, rounds: int = 15) -> list[str]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(num_threads)
    lines = [f"## gemm: plain F.linear vs oneDNN prepacked, {num_threads} thread(s), best-round us per call", "",
             "| dtype | layer (out x in) | M | plain us | prepacked us | speedup |", "|---|---|---|---|---|---|"]
    for dtype in (torch.bfloat16, torch.float32):
        for layer, (out_features, in_features) in LINEAR_SHAPES.items():
            weight = (torch.randn(out_features, in_features) / in_features ** 0.5).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            for m in (1, 16, 64, 256):
                x = torch.randn(m, in_features).to(dtype)
                calls = 3 if layer == "lm_head" else 20
                variants = {"plain": lambda: F.linear(x, weight),
                            "prepacked": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")}
                samples: dict[str, list[float]] = {name: [] for name in variants}
                for function in variants.values():
                    function()
                for _ in range(rounds):
                    for name, function in variants.items():
                        begin = time.perf_counter()
                        for _ in range(calls):
                            function()
                        samples[name].append((time.perf_counter() - begin) / calls * 1e6)
                plain, prepacked = (min(samples[name]) for name in ("plain", "prepacked"))
                lines.append(f"| {str(dtype).removeprefix('torch.')} | {layer} ({out_features}x{in_features}) | {m} | "
                             f"{plain:.1f} | {prepacked:.1f} | {plain / prepacked:.2f}x |")
                print(lines[-1], flush=True)
    return lines


# ---- 3. decode ----------------------------------------------------------------------------------
def bench_decode(dtype: str, repeats: int) -> list[str]:
    from benchmark_model import benchmark_model_folder

    from pagedserve import LLM, SamplingParams

    folder = benchmark_model_folder()
    engines = {layout: LLM(folder, dtype=dtype, max_model_len=512, num_kv_blocks=256, max_num_batched_tokens=512,
                           weight_layout=layout, num_cpu_threads=2, enforce_eager=True)
               for layout in ("plain", "prepacked")}
    lines = [f"## decode step: weight_layout plain vs prepacked, {dtype}, eager forward, 2 threads", "",
             "| batch | plain ms/step | prepacked ms/step | speedup |", "|---|---|---|---|"]
    for batch in (1, 16):
        prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 40000 + 3 for j in range(32)]} for i in range(batch)]

        def timed(llm: LLM, max_tokens: int) -> float:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            begin = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - begin

        step_ms: dict[str, list[float]] = {layout: [] for layout in engines}
        for llm in engines.values():
            timed(llm, 2)
        for _ in range(repeats):  # interleaved, so both see the same machine load
            for layout, llm in engines.items():
                step_ms[layout].append((timed(llm, 65) - timed(llm, 1)) / 64 * 1000)
        plain, prepacked = (statistics.median(step_ms[layout]) for layout in ("plain", "prepacked"))
        lines.append(f"| {batch} | {plain:.2f} | {prepacked:.2f} | {plain / prepacked:.2f}x |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--parts", default="load,gemm,decode")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the gemm part")
    parser.add_argument("--child-load", default=None, help=argparse.SUPPRESS)
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    if args.child_load:
        folder, strategy, num_threads, dtype = json.loads(args.child_load)
        print(json.dumps(child_load(folder, strategy, num_threads, dtype)))
        return
    parts = args.parts.split(",")
    if "decode" in parts:  # the engine's decode steps (load and gemm time no native kernel)
        native_guard.require_native_kernels(args.allow_plain_pytorch)
    lines: list[str] = []
    if "load" in parts:
        lines += bench_load(args.dtype, args.repeats) + [""]
    if "gemm" in parts:
        lines += bench_gemm(args.threads) + [""]
    if "decode" in parts:
        lines += bench_decode(args.dtype, args.repeats) + [""]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
