"""`pagedserve bench serve` flags (no heavy imports)."""
from __future__ import annotations

import argparse


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the 'model' value to send")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--api-key", default=None, help="bearer key (default: $OPENAI_API_KEY when set)")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--dataset", choices=["random", "file"], default="random")
    parser.add_argument("--dataset-path", default=None,
                        help="file prompts: a text file (one prompt per line) or JSON lines with a 'prompt' field")
    parser.add_argument("--input-len-range", type=int, nargs=2, default=[64, 512], metavar=("MIN", "MAX"),
                        help="random prompts: token count drawn uniformly from [MIN, MAX]")
    parser.add_argument("--output-len-range", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"),
                        help="max_tokens drawn uniformly from [MIN, MAX] (sent with ignore_eos)")
    parser.add_argument("--vocab-range", type=int, nargs=2, default=[100, 1000], metavar=("LOW", "HIGH"),
                        help="random prompts: token ids drawn from [LOW, HIGH)")
    parser.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos=true")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Poisson arrival rate in requests/s (inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--goodput", nargs="*", default=[], metavar="METRIC:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000 (milliseconds)")
    parser.add_argument("--percentiles", default="50,90,99", help="comma-separated percentiles to report")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    parser.add_argument("--result-file", default=None, help="write the results as JSON here")
    parser.add_argument("--warmup-requests", type=int, default=0)
