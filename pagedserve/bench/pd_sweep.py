"""Real splits through the proxy (`pagedserve bench pd --sweep`): for each xPyD (and N colocated engines), start the
servers and a `pagedserve proxy` over them on this host, send the workload through the proxy with
`pagedserve bench serve`'s load generator, and report goodput within the SLOs. Every process is stopped (its
whole process group) whatever happens.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import httpx

from pagedserve.bench.serve import BenchRequest, run_benchmark, summarize

SERVED_MODEL_NAME = "bench"
PRODUCER = {"kv_connector": "PullConnector", "kv_role": "kv_producer"}
CONSUMER = {"kv_connector": "PullConnector", "kv_role": "kv_consumer"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LaunchedProcess:
    """A `pagedserve` child in its own session, healthy on its port, stopped as a process group."""

    def __init__(self, arguments: list[str], port: int, startup_timeout: float) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="pagedserve-bench-pd-", suffix=".log", delete=False)
        self.process = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", *arguments, "--port", str(port)],
                                        stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                        env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.startup_timeout = startup_timeout

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.url} exited with {self.process.returncode} while starting:\n"
                                   f"{open(self.log.name, errors='replace').read()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.url} not healthy within {self.startup_timeout} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=10)
        self.log.close()


@dataclass(frozen=True)
class Layout:
    """One arrangement of N instances behind the proxy: num_prefill P and num_decode D, or colocated engines."""

    num_prefill: int
    num_decode: int

    @property
    def name(self) -> str:
        return f"{self.num_prefill}P{self.num_decode}D" if self.num_prefill else f"{self.num_decode} colocated"


def sweep_layouts(num_instances: int, splits: list[str] | None) -> list[Layout]:
    """The layouts to run: the given 'xPyD' names (or every split of num_instances), then N colocated engines."""
    if splits:
        layouts = []
        for name in splits:
            text = name.upper()
            if not (text.endswith("D") and "P" in text):
                raise ValueError(f"split {name!r} must read xPyD, e.g. 1P1D")
            prefill, decode = text[:-1].split("P", 1)
            if not (prefill.isdigit() and decode.isdigit() and int(prefill) >= 1 and int(decode) >= 1):
                raise ValueError(f"split {name!r} must read xPyD with x, y >= 1")
            layouts.append(Layout(int(prefill), int(decode)))
    else:
        layouts = [Layout(x, num_instances - x) for x in range(1, num_instances)]
    return layouts + [Layout(0, num_instances)]


def run_layout(layout: Layout, model: str, serve_args: list[str], requests: list[BenchRequest], *,
               request_rate: float, slos: dict[str, float], seed: int, startup_timeout: float = 600.0,
               warmup_requests: int = 2) -> dict[str, Any]:
    """Start the layout's servers and proxy, run the workload through the proxy, stop everything; the summary."""
    processes: list[LaunchedProcess] = []
    try:
        common = ["serve", "--model", model, "--served-model-name", SERVED_MODEL_NAME, *serve_args]
        roles = [PRODUCER] * layout.num_prefill + [CONSUMER if layout.num_prefill else None] * layout.num_decode
        servers = []
        for role in roles:
            extra = ["--kv-transfer-config", json.dumps(role)] if role is not None else []
            servers.append(LaunchedProcess(common + extra, free_port(), startup_timeout))
        processes.extend(servers)
        for server in servers:
            server.wait_healthy()
        prefill_urls = [server.url for server in servers[:layout.num_prefill]]
        decode_urls = [server.url for server in servers[layout.num_prefill:]]
        proxy = LaunchedProcess(["proxy", "--prefill", *prefill_urls, "--decode", *decode_urls], free_port(), 120)
        processes.append(proxy)
        proxy.wait_healthy()
        results, duration = asyncio.run(run_benchmark(proxy.url, SERVED_MODEL_NAME, requests,
                                                      request_rate=request_rate, seed=seed,
                                                      warmup_requests=warmup_requests))
        return summarize(results, duration, [50, 90, 99], slos)
    finally:
        for process in reversed(processes):
            process.stop()


def format_sweep_row(layout: Layout, summary: dict[str, Any]) -> str:
    return (f"| {layout.name} | {summary['completed']} / {summary['failed']} | "
            f"{summary.get('goodput_requests_per_s', 0.0):.2f} | {summary['request_throughput']:.2f} | "
            f"{summary['ttft']['p50']:.0f} / {summary['ttft']['p99']:.0f} | "
            f"{summary['tpot']['p50']:.1f} / {summary['tpot']['p99']:.1f} |")


SWEEP_HEADER = ("| layout | completed / failed | goodput req/s | req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms |\n"
                "|---|---|---|---|---|---|")
