"""Serving benchmark (issue #4): HTTP latency at Poisson 2 and 8 req/s, and the server's own overhead.

For each request rate it runs the same seeded workload twice:
  1. through HTTP: `pagedserve serve` in a child process, driven by `pagedserve bench serve`'s
     load generator (streaming /v1/completions, Poisson arrivals);
  2. in process: the same requests at the same arrival times fed straight into LLMEngine (the
     engine LLM.generate uses), with per-token timestamps from delta outputs;
and reports TTFT / TPOT p50 and p99, throughput, and the HTTP overhead on mean TPOT (target < 10%
at 8 req/s).

Issue settings (default): the default model in bf16, 100 requests, prompts [64, 512] tokens, outputs
[32, 128], rates 2 and 8; the result goes to results/serving_<dtype>_<cpu kind>.json (cpu_kind.py) unless
--result-file names another file:

    python benchmarks/serving.py --dtype bfloat16

Smaller runs for a busy CPU: --num-prompts 20 --input-len-range 32 128 --output-len-range 16 48 --rates 1 4
    --threads 1 --engine-arg=--max-model-len --engine-arg=1024
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx
import numpy as np

from pagedserve.bench.serve import BenchRequest, RequestResult, make_requests, run_benchmark, summarize

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_kind import result_path  # noqa: E402
import native_guard  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str | None, engine_args: list[str], port: int, threads: int | None) -> subprocess.Popen:
    command = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(port), *engine_args]
    if model:
        command += ["--model", model]
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    process = subprocess.Popen(command, start_new_session=True, env=env)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not become healthy")


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def engine_kwargs_of(engine_args: list[str]) -> dict[str, Any]:
    """The in-process engine's keyword arguments for the same --engine-arg flags the server gets."""
    from pagedserve.config.cli_args import add_engine_args, engine_kwargs_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs_from_args(parser.parse_args(engine_args))
    kwargs.pop("model")
    kwargs.pop("dtype")
    return kwargs


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """The arrival times run_benchmark uses (same generator, same order)."""
    rng = np.random.default_rng(seed + 1)
    offsets, now = [], 0.0
    for index in range(num_requests):
        offsets.append(now)
        if index < num_requests - 1:
            now += float(rng.exponential(1.0 / rate))
    return offsets


def run_in_process(engine: Any, requests: list[BenchRequest], rate: float,
                   seed: int) -> tuple[list[RequestResult], float]:
    """Replay the workload on an LLMEngine at the same arrival times; per-token times from delta outputs."""
    from pagedserve.sampling_params import SamplingParams

    offsets = arrival_offsets(len(requests), rate, seed)
    results = [RequestResult(success=False, prompt_len=r.prompt_len or 0) for r in requests]
    starts: dict[str, float] = {}
    last: dict[str, float] = {}
    next_index = 0
    start = time.perf_counter()
    num_done = 0
    while num_done < len(requests):
        now = time.perf_counter() - start
        while next_index < len(requests) and offsets[next_index] <= now:
            request = requests[next_index]
            request_id = f"bench-{next_index}"
            params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)
            engine.add_request(request_id, {"prompt_token_ids": request.prompt}, params, output_kind="delta")
            starts[request_id] = time.perf_counter()
            next_index += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, offsets[next_index] - (time.perf_counter() - start)))
            continue
        for output in engine.step():
            index = int(output.request_id.split("-")[1])
            result = results[index]
            stamp = time.perf_counter()
            num_new = len(output.outputs[0].token_ids)
            if num_new:
                if result.output_tokens == 0:
                    result.ttft = stamp - starts[output.request_id]
                else:
                    result.itl.append(stamp - last[output.request_id])
                last[output.request_id] = stamp
                result.output_tokens += num_new
            if output.finished:
                result.e2el = stamp - starts[output.request_id]
                result.success = True
                num_done += 1
    return results, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=[64, 512])
    parser.add_argument("--output-len-range", type=int, nargs=2, default=[32, 128])
    parser.add_argument("--vocab-range", type=int, nargs=2, default=[100, 30000])
    parser.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-arg", action="append", default=[], help="extra engine flag (repeatable)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for both paths (OMP_NUM_THREADS for the server, torch.set_num_threads "
                             "in process); on a shared CPU, oversubscribed threads swamp the comparison")
    parser.add_argument("--skip-in-process", action="store_true")
    parser.add_argument("--result-file", default=None,
                        help="result file (default: results/serving_<dtype>_<cpu kind>.json; '' writes none)")
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_kernels = native_guard.require_native_kernels(args.allow_plain_pytorch)
    if args.result_file is None:
        args.result_file = result_path("serving", args.dtype)

    requests = make_requests(args.num_prompts, "random", None, tuple(args.input_len_range),
                             tuple(args.output_len_range), tuple(args.vocab_range), args.seed)
    engine_args = ["--dtype", args.dtype, *args.engine_arg]
    report: dict[str, Any] = {"config": vars(args), "native_kernels": native_kernels, "rates": {}}
    port = free_port()
    server = start_server(args.model, engine_args, port, args.threads)
    try:
        model_name = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        # Warm-up (not measured).
        asyncio.run(run_benchmark(f"http://127.0.0.1:{port}", model_name, requests[:4], seed=args.seed))
        for rate in args.rates:
            results, duration = asyncio.run(run_benchmark(f"http://127.0.0.1:{port}", model_name, requests,
                                                          request_rate=rate, seed=args.seed))
            report["rates"][str(rate)] = {"http": summarize(results, duration, [50, 90, 99], {})}
    finally:
        stop_server(server)

    if not args.skip_in_process:
        import torch

        from pagedserve.engine.llm_engine import LLMEngine

        if args.threads is not None:
            torch.set_num_threads(args.threads)
        engine = LLMEngine.from_kwargs(args.model, dtype=args.dtype, **engine_kwargs_of(args.engine_arg))
        run_in_process(engine, requests[:4], float("inf"), args.seed)  # warm-up
        for rate in args.rates:
            results, duration = run_in_process(engine, requests, rate, args.seed)
            report["rates"][str(rate)]["in_process"] = summarize(results, duration, [50, 90, 99], {})
        engine.shutdown()

    print(f"{'rate':>5} {'path':<11} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
          f"{'TPOT mean':>9} {'req/s':>6} {'out tok/s':>9}  (ms)")
    for rate, entry in report["rates"].items():
        for path, summary in entry.items():
            print(f"{rate:>5} {path:<11} {summary['ttft']['p50']:9.1f} {summary['ttft']['p99']:9.1f} "
                  f"{summary['tpot']['p50']:9.1f} {summary['tpot']['p99']:9.1f} {summary['tpot']['mean']:9.1f} "
                  f"{summary['request_throughput']:6.2f} {summary['output_throughput']:9.1f}")
        if "in_process" in entry and entry["in_process"]["tpot"]["mean"] > 0:
            overhead = entry["http"]["tpot"]["mean"] / entry["in_process"]["tpot"]["mean"] - 1.0
            entry["http_tpot_overhead"] = overhead
            print(f"{rate:>5} HTTP overhead on mean TPOT: {overhead * 100:+.1f}%")
    if args.result_file:
        os.makedirs(os.path.dirname(os.path.abspath(args.result_file)), exist_ok=True)
        with open(args.result_file, "w") as f:
            json.dump(report, f, indent=2, default=str)
        print(f"wrote {args.result_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
