"""Plot issue #7's side-by-side results (recipes A, B, C) of one CPU kind into one PNG for benchmarks/README.md.

Reads the JSON files the recipes write for that CPU kind (cpu_kind.py; missing ones are left out of the figure):
  results/offline_vs_vllm_{bfloat16,float32}_<cpu kind>.json   (offline_vs_vllm.py)
  results/decode_roofline_{bfloat16,float32}_<cpu kind>.json   (decode_roofline.py)
  results/serving_vs_vllm_{bfloat16,float32}_<cpu kind>.json   (serving_vs_vllm.py)
and writes results/vllm_comparison_<cpu kind>.png. The CPU kind defaults to this machine's.

    pip install matplotlib   # benchmark-only, not a dependency of pagedserve
    python benchmarks/plot_vllm_comparison.py [--cpu-kind zen4-avx512bf16]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_kind import RESULTS, cpu_kind, result_path  # noqa: E402

DTYPES = ("bfloat16", "float32")


def load(recipe: str, dtype: str, kind: str) -> dict | list | None:
    path = result_path(recipe, dtype, kind)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def bars(axis, groups: list[str], series: dict[str, list[float]], title: str, ylabel: str,
         is_log: bool = False) -> None:
    width = 0.8 / max(1, len(series))
    for index, (label, values) in enumerate(series.items()):
        positions = [g + index * width for g in range(len(groups))]
        drawn = axis.bar(positions, values, width, label=label)
        axis.bar_label(drawn, fmt="%.0f", fontsize=7)
    axis.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups, fontsize=8)
    axis.set_title(title, fontsize=9)
    axis.set_ylabel(ylabel, fontsize=8)
    # Headroom above the tallest bar keeps the legend off the bars.
    tallest = max((v for values in series.values() for v in values), default=0.0)
    if is_log:  # values spanning decades (serving latencies: tens of ms to seconds)
        axis.set_yscale("log")
        axis.set_ylim(top=tallest * 8 if tallest > 0 else 10.0)
    else:
        axis.set_ylim(0, tallest * 1.35 if tallest > 0 else 1.0)
    axis.legend(fontsize=7, ncols=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-kind", default=None, help="whose results to plot (default: this machine's kind)")
    parser.add_argument("--out", default=None, help="default: results/vllm_comparison_<cpu kind>.png")
    args = parser.parse_args()
    kind = args.cpu_kind or cpu_kind()
    args.out = args.out or os.path.join(RESULTS, f"vllm_comparison_{kind}.png")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(14, 4))
    offline = {dtype: load("offline_vs_vllm", dtype, kind) for dtype in DTYPES}
    groups = [dtype for dtype in DTYPES if offline[dtype]]
    series: dict[str, list[float]] = {"pagedserve": [], "vLLM CPU": []}
    for dtype in groups:
        # A file may hold several runs of an engine (a rerun): plot each engine's best.
        best: dict[str, float] = {}
        for run in offline[dtype]:
            best[run["engine"]] = max(best.get(run["engine"], 0.0), run["output_tokens_per_s"])
        series["pagedserve"].append(best["pagedserve"])
        series["vLLM CPU"].append(best["vllm-cpu"])
    bars(axes[0], groups, series, "A. offline throughput (64 requests)", "output tokens/s")

    roofline = {dtype: load("decode_roofline", dtype, kind) for dtype in DTYPES}
    groups = [dtype for dtype in DTYPES if roofline[dtype]]
    series = {"roofline": [], "pagedserve": [], "vLLM CPU": []}
    for dtype in groups:
        result = roofline[dtype]
        series["roofline"].append(result["roofline_tokens_per_s"])
        series["pagedserve"].append(result["pagedserve_tokens_per_s"])
        series["vLLM CPU"].append(result.get("vllm_tokens_per_s", 0.0))
    bars(axes[1], groups, series, "B. batch-1 decode vs bandwidth roofline", "tokens/s")

    groups, series = [], {"pagedserve TPOT p50": [], "vLLM TPOT p50": [], "pagedserve TTFT p50": [],
                          "vLLM TTFT p50": []}
    for dtype in DTYPES:
        serving = load("serving_vs_vllm", dtype, kind)
        if not serving or len(serving["reports"]) < 2:
            continue
        ours, theirs = serving["reports"][0]["rates"], serving["reports"][1]["rates"]
        for rate in ours:
            groups.append(f"{dtype[:4]} {float(rate):g} req/s")
            series["pagedserve TPOT p50"].append(ours[rate]["tpot"]["p50"])
            series["vLLM TPOT p50"].append(theirs[rate]["tpot"]["p50"])
            series["pagedserve TTFT p50"].append(ours[rate]["ttft"]["p50"])
            series["vLLM TTFT p50"].append(theirs[rate]["ttft"]["p50"])
    bars(axes[2], groups, series, "C. serving latency (lower is better; log scale)", "ms", is_log=True)
    threads = next((r["threads"] for r in roofline.values() if r and "threads" in r), None)
    figure.suptitle(f"pagedserve vs vLLM CPU 0.32 — SmolLM2-135M-shaped model"
                    f"{f', {threads} threads' if threads else ''}, CPU kind {kind}", fontsize=10)
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
