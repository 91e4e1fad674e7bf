"""Process start to first chat token with the default model, cold (empty cache) and warm.

Runs `pagedserve chat` as a user would (stdin not a TTY, one question) and measures the wall time
from process start to the first byte of the answer on stdout, and to process exit.

    python benchmarks/chat_startup.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

QUESTION = b"What is the capital of France?\n"


def time_to_first_token(cache_dir: str) -> tuple[float, float, str]:
    env = dict(os.environ, PAGEDSERVE_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", "chat", "--temperature", "0",
                                "--max-tokens", "32"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, env=env)
    process.stdin.write(QUESTION)
    process.stdin.close()
    first = process.stdout.read(1)
    first_token_s = time.perf_counter() - start
    rest = process.stdout.read()
    process.wait()
    return first_token_s, time.perf_counter() - start, (first + rest).decode(errors="replace").strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cold, warm = [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache_dir:
            cold.append(time_to_first_token(cache_dir))
            warm.append(time_to_first_token(cache_dir))
    for name, runs in (("cold (no cache)", cold), ("warm (cache present)", warm)):
        firsts = [r[0] for r in runs]
        totals = [r[1] for r in runs]
        print(f"{name:<22} first token median {statistics.median(firsts):6.2f} s (min {min(firsts):.2f})   "
              f"exit median {statistics.median(totals):6.2f} s")
    print("answer:", warm[-1][2])


if __name__ == "__main__":
    main()
