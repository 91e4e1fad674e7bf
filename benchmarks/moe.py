"""MoE benchmarks: the grouped (fused) expert path vs the dense per-expert reference, and an EPLB simulation.

    python benchmarks/moe.py [--threads N]

1. Fused MoE vs reference at 1, 16 and 128 tokens (16 experts, top-2, hidden 512, intermediate 256,
   float32): median milliseconds per call.
2. EPLB simulation: 16 experts on 4 EP ranks, per-step token counts drawn from a Zipf popularity over
   shuffled experts (200 steps of 512 routed tokens, fixed seed); max/mean tokens per rank of the identity
   placement and of the 'default' and 'flashlb' policies, for Zipf exponents 0.5, 1.0, 1.5 and 0, 4, 8
   redundant experts.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pagedserve.eplb.placement_policy import get_policy
from pagedserve.layers.moe.expert_placement import identity_placement, imbalance
from pagedserve.layers.moe.fused_experts import fused_experts, reference_experts
from pagedserve.layers.moe.router import select_experts

NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 16, 2, 512, 256


def time_call(function, repeats: int) -> float:  # type: ignore[no-untyped-def]
    function()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def fused_vs_reference() -> list[str]:
    generator = torch.Generator().manual_seed(0)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) * 0.05
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) * 0.05
    rows = ["| tokens | fused (ms) | reference (ms) | speed-up | max abs diff |", "|---|---|---|---|---|"]
    for num_tokens in (1, 16, 128):
        hidden = torch.randn(num_tokens, HIDDEN, generator=generator)
        weights, ids = select_experts(torch.randn(num_tokens, NUM_EXPERTS, generator=generator), TOP_K,
                                      renormalize=True)
        with torch.inference_mode():
            fused_ms = time_call(lambda: fused_experts(hidden, w13, w2, weights, ids), 30)
            reference_ms = time_call(lambda: reference_experts(hidden, w13, w2, weights, ids), 30)
            difference = (fused_experts(hidden, w13, w2, weights, ids)
                          - reference_experts(hidden, w13, w2, weights, ids)).abs().max().item()
        rows.append(f"| {num_tokens} | {fused_ms:.3f} | {reference_ms:.3f} | {reference_ms / fused_ms:.1f}x "
                    f"| {difference:.1e} |")
    return rows


def zipf_loads(num_experts: int, exponent: float, steps: int, tokens_per_step: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, num_experts + 1) ** exponent
    popularity = popularity[rng.permutation(num_experts)]
    return rng.multinomial(tokens_per_step, popularity / popularity.sum(), size=steps)


def eplb_simulation(num_ranks: int = 4) -> list[str]:
    rows = ["| zipf exponent | redundant experts | identity | default | flashlb | flashlb policy time (ms) |",
            "|---|---|---|---|---|---|"]
    for exponent in (0.5, 1.0, 1.5):
        loads = zipf_loads(NUM_EXPERTS, exponent, steps=200, tokens_per_step=512, seed=0)
        total = torch.from_numpy(loads.sum(axis=0))
        for num_redundant in (0, 4, 8):
            identity = identity_placement(NUM_EXPERTS, num_redundant, num_ranks)
            slots = (NUM_EXPERTS + num_redundant) // num_ranks
            results = []
            for name in ("default", "flashlb"):
                start = time.perf_counter()
                placement = get_policy(name).place(loads, num_ranks, slots, identity.numpy())
                elapsed = (time.perf_counter() - start) * 1e3
                results.append(imbalance(total, torch.from_numpy(placement), num_ranks))
            rows.append(f"| {exponent} | {num_redundant} | {imbalance(total, identity, num_ranks):.3f} "
                        f"| {results[0]:.3f} | {results[1]:.3f} | {elapsed:.1f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"## Fused MoE vs dense reference ({NUM_EXPERTS} experts, top-{TOP_K}, hidden {HIDDEN}, "
          f"intermediate {INTERMEDIATE}, float32, {torch.get_num_threads()} threads)\n")
    print("\n".join(fused_vs_reference()))
    print(f"\n## EPLB simulation: max/mean tokens per rank ({NUM_EXPERTS} experts, 4 ranks, 200 steps x 512 tokens)\n")
    print("\n".join(eplb_simulation()))


if __name__ == "__main__":
    main()
