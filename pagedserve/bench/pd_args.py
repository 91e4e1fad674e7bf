"""`pagedserve bench pd` flags (no heavy imports)."""
from __future__ import annotations

import argparse


def add_bench_pd_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model folder (as `pagedserve serve --model`)")
    parser.add_argument("--serve-args", default="",
                        help="engine flags, as one string, for the measured engine and every server of --sweep, "
                             "e.g. '--dtype bfloat16 --max-model-len 1024 --num-cpu-threads 1'")
    parser.add_argument("--input-len-range", type=int, nargs=2, default=[64, 512], metavar=("MIN", "MAX"),
                        help="prompt tokens, uniform in [MIN, MAX] (recipe C's workload by default)")
    parser.add_argument("--output-len-range", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"),
                        help="output tokens, uniform in [MIN, MAX]")
    parser.add_argument("--vocab-range", type=int, nargs=2, default=[100, 1000], metavar=("LOW", "HIGH"),
                        help="random prompt token ids drawn from [LOW, HIGH)")
    parser.add_argument("--ttft-slo-ms", type=float, default=1000.0, help="time-to-first-token SLO")
    parser.add_argument("--tpot-slo-ms", type=float, default=100.0, help="time-per-output-token SLO")
    parser.add_argument("--num-instances", type=int, default=2, help="N: the instances to split into xPyD")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 32, 64],
                        help="decode batch sizes to time (capped by --max-num-seqs and the KV cache)")
    parser.add_argument("--num-prefill-prompts", type=int, default=8, help="prompts timed for the prefill rate")
    parser.add_argument("--num-decode-steps", type=int, default=16, help="decode steps timed per batch size")
    parser.add_argument("--seed", type=int, default=0)
    sweep = parser.add_argument_group("sweep (real splits through `pagedserve proxy` on this host)")
    sweep.add_argument("--sweep", action="store_true",
                       help="also run every xPyD of --num-instances and N colocated engines behind the proxy")
    sweep.add_argument("--skip-measure", action="store_true", help="with --sweep: skip the capacity measurement")
    sweep.add_argument("--splits", nargs="*", default=None, metavar="xPyD",
                       help="the splits to run (default: every split of --num-instances)")
    sweep.add_argument("--request-rate", type=float, default=2.0, help="Poisson arrivals, requests/s")
    sweep.add_argument("--num-prompts", type=int, default=50)
    sweep.add_argument("--result-file", default=None, help="write the measurement and the sweep as JSON here")
