"""The TTFT that prefill/decode disaggregation adds, P and D on one host, against one engine (issue #32, part 3).

    PYTHONPATH=. python benchmarks/pd_proxy_ttft.py [--prompt-lens 512 2048 8000] [--repeats 3] [--dtype bfloat16] \
        [--modes pull push]

Three ways to the same SmolLM2-shaped benchmark model (benchmark_model.py), all servers up at once:
  - engine:        one `pagedserve serve`, requests sent straight to it;
  - engine+proxy:  the same engine behind `pagedserve proxy --decode` (the proxy's own cost);
  - 1P1D:          `pagedserve proxy --prefill P --decode D`, P and D servers with the PullConnector over zmq,
                   one pair and proxy per `--modes` value (pull: P prefills, then D pulls; push: the proxy sends
                   D and P the request at once and P pushes each layer as it computes it: `--kv-transfer-mode`).
Each request is one fresh random prompt of the given length (no prefix-cache hit anywhere), max_tokens 4, streamed;
TTFT is the time to the first streamed token, as `pagedserve bench serve` measures it. Requests go one at a time,
in rounds that rotate which way goes first; the figure is the median over --repeats rounds.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys

import httpx

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmark_model import benchmark_model_folder  # noqa: E402
from pagedserve.bench.pd_sweep import CONSUMER, PRODUCER, SERVED_MODEL_NAME, LaunchedProcess, free_port  # noqa: E402
from pagedserve.bench.serve import BenchRequest, send_request  # noqa: E402
import native_guard  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048, 8000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--engine-arg", action="append", default=[], help="extra `pagedserve serve` flag")
    parser.add_argument("--modes", nargs="+", choices=["pull", "push"], default=["pull"],
                        help="the PullConnector modes to run 1P1D with (a P/D pair and a proxy each)")
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_guard.require_native_kernels(args.allow_plain_pytorch)
    import json
    import signal

    # SIGTERM unwinds like Ctrl-C, so the finally below stops every server.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))

    import numpy as np

    model = benchmark_model_folder()
    max_len = max(args.prompt_lens) + 64  # the benchmark model has 8192 positions: 8000 is the "8k" prompt
    common = ["serve", "--model", model, "--served-model-name", SERVED_MODEL_NAME, "--dtype", args.dtype,
              "--max-model-len", str(max_len), "--kv-cache-memory", "1GiB", *args.engine_arg]
    processes: list[LaunchedProcess] = []
    try:
        engine = LaunchedProcess(common, free_port(), 900)
        processes.append(engine)
        pairs = {}
        for mode in args.modes:
            extra = {"kv_connector_extra_config": {"mode": mode}}
            pairs[mode] = tuple(LaunchedProcess(common + ["--kv-transfer-config", json.dumps({**role, **extra})],
                                                free_port(), 900) for role in (PRODUCER, CONSUMER))
            processes += pairs[mode]
        for process in processes:
            process.wait_healthy()
        ways = {"engine": engine.url}
        proxies = {"engine+proxy": LaunchedProcess(["proxy", "--decode", engine.url], free_port(), 120)}
        for mode, (prefill, decode) in pairs.items():
            proxies[f"1P1D {mode}"] = LaunchedProcess(["proxy", "--prefill", prefill.url, "--decode", decode.url,
                                                       "--kv-transfer-mode", mode], free_port(), 120)
        processes += proxies.values()
        for name, proxy in proxies.items():
            proxy.wait_healthy()
            ways[name] = proxy.url
        rng = np.random.default_rng(0)

        async def ttft(url: str, length: int) -> float:
            request = BenchRequest(prompt=rng.integers(100, 40000, size=length).tolist(), prompt_len=length,
                                   max_tokens=4)
            async with httpx.AsyncClient(timeout=600) as http:
                result = await send_request(http, url + "/v1/completions", {}, SERVED_MODEL_NAME, request, 0.0, True)
            if not result.success:
                raise RuntimeError(f"{url}: {result.error}")
            return result.ttft

        for url in ways.values():  # warm-up
            asyncio.run(ttft(url, 64))
        names = list(ways)
        pd_ways = [name for name in names if name.startswith("1P1D")]
        print("| prompt tokens | " + " | ".join(f"{name} TTFT ms" for name in names) + " | "
              + " | ".join(f"{name} - engine ms | {name} / engine" for name in pd_ways) + " |")
        print("|---" * (1 + len(names) + 2 * len(pd_ways)) + "|")
        for length in args.prompt_lens:
            times: dict[str, list[float]] = {name: [] for name in names}
            for round_index in range(args.repeats):
                order = names[round_index % len(names):] + names[:round_index % len(names)]
                for name in order:
                    times[name].append(asyncio.run(ttft(ways[name], length)))
            median = {name: statistics.median(values) * 1000 for name, values in times.items()}
            print(f"| {length} | " + " | ".join(f"{median[name]:.0f}" for name in names) + " | "
                  + " | ".join(f"{median[name] - median['engine']:+.0f} | {median[name] / median['engine']:.2f}x"
                               for name in pd_ways) + " |", flush=True)
            print("  runs (ms): " + "; ".join(f"{name} " + ", ".join(f"{value * 1000:.0f}" for value in values)
                                              for name, values in times.items()), flush=True)
    finally:
        for process in reversed(processes):
            process.stop()


if __name__ == "__main__":
    main()
