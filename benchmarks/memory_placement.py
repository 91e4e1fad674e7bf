"""Read bandwidth per buffer: does this machine stream every allocation at the same speed?

Recipe B's roofline divides a decode token's bytes by the read bandwidth of a freshly allocated 1 GiB buffer. On the
AMD EPYC Zen 4 VM (zen4-avx512bf16 in benchmarks/README.md) that figure moves between ~27 and ~60 GB/s within
minutes. This script shows why: it allocates several buffers a few seconds apart, keeps them all, and measures each
one's read bandwidth (torch's sum, best of three) every round. At the same moment, buffers differ by up to 1.6x, and
a buffer mostly keeps its speed: on that VM seven 512 MiB buffers read at 38.6, 51.8, 57.6, 63.9, 63.6, 62.6,
62.7 GB/s, each within ~3 GB/s of that at every later round; in another run a first buffer went from 32 to 48 GB/s
after ~7 s while the others held. The speed follows where a buffer's memory lands (and what the host does with
it), not only the moment it is read. A model's weights are read from wherever they landed at load time; the
roofline's probe buffer lands elsewhere.

    python benchmarks/memory_placement.py [--buffers 7] [--mib 512] [--interval 6] [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import torch


def read_bandwidth_gb_s(buffer: torch.Tensor, repeats: int = 3) -> float:
    buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * buffer.element_size() / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buffers", type=int, default=7)
    parser.add_argument("--mib", type=int, default=512, help="size of each buffer")
    parser.add_argument("--interval", type=float, default=6.0, help="seconds between allocations")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    buffers: list[tuple[float, torch.Tensor]] = []
    for _ in range(args.buffers):
        buffers.append((time.perf_counter() - start, torch.ones(args.mib * (1 << 20) // 4)))
        row = "  ".join(f"[{allocated:3.0f} s] {read_bandwidth_gb_s(buffer):5.1f}" for allocated, buffer in buffers)
        print(f"t={time.perf_counter() - start:4.0f} s  GB/s per buffer (allocated at): {row}", flush=True)
        time.sleep(args.interval)


if __name__ == "__main__":
    main()
