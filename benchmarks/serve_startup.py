"""Start to ready of `pagedserve serve`: process start to the first `/health` 200, warm (caches filled).

Starts the server on the SmolLM2-shaped benchmark model --repeats times, one at a time, and prints each
time and the best. (serving_vs_vllm.py reports the same figure once per engine alongside recipe C.)

    python benchmarks/serve_startup.py [--repeats 3] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_model import benchmark_model_folder  # noqa: E402


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_to_ready(folder: str, dtype: str, timeout_s: float = 300.0) -> float:
    port = free_port()
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", "serve", "--model", folder, "--dtype", dtype,
                                "--port", str(port), "--max-model-len", "1024", "--kv-cache-memory", "4GiB"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while time.perf_counter() - start < timeout_s:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with status {process.returncode} while starting")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"the server was not ready within {timeout_s} s")
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    folder = benchmark_model_folder()
    start_to_ready(folder, args.dtype)  # fills the caches (native library, model files in the page cache)
    times = [start_to_ready(folder, args.dtype) for _ in range(args.repeats)]
    print("start to ready, s: " + ", ".join(f"{t:.2f}" for t in times) + f"; best {min(times):.2f}")


if __name__ == "__main__":
    main()
