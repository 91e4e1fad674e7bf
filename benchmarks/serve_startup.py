"""Start to ready of `pagedserve serve`: process start to the first `/health` 200, warm (caches filled).

Starts the server on the SmolLM2-shaped benchmark model --repeats times, one at a time, and prints each
time and the best. (serving_vs_vllm.py reports the same figure once per engine alongside recipe C; this
script reuses its launch command and health wait.)

    python benchmarks/serve_startup.py [--repeats 3] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_model import benchmark_model_folder  # noqa: E402
import native_guard  # noqa: E402
from serving import free_port  # noqa: E402
from serving_vs_vllm import pagedserve_command, stop, wait_healthy  # noqa: E402


def start_to_ready(folder: str, dtype: str, timeout_s: float = 300.0) -> float:
    port = free_port()
    process = subprocess.Popen(pagedserve_command(folder, dtype, port, []), start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return wait_healthy(process, port, timeout_s)
    finally:
        stop(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_guard.require_native_kernels(args.allow_plain_pytorch)
    folder = benchmark_model_folder()
    start_to_ready(folder, args.dtype)  # fills the caches (native library, model files in the page cache)
    times = [start_to_ready(folder, args.dtype) for _ in range(args.repeats)]
    print("start to ready, s: " + ", ".join(f"{t:.2f}" for t in times) + f"; best {min(times):.2f}")


if __name__ == "__main__":
    main()
