"""`pagedserve bench pd` for real on a tiny model: the measurement and the recommendation (default suite), and a
sweep of 1P1D and two colocated engines through the proxy (slow: four servers)."""
from __future__ import annotations

import json

import pytest

from pagedserve.cli import main

SERVE_ARGS = "--dtype float32 --max-model-len 512 --num-kv-blocks 96 --block-size 16 --num-cpu-threads 1"
WORKLOAD = ["--input-len-range", "16", "48", "--output-len-range", "4", "8", "--vocab-range", "10", "600"]


def test_bench_pd_measures_and_recommends(tiny_model_dir, tmp_path, capsys):
    result_file = tmp_path / "pd.json"
    status = main(["bench", "pd", "--model", tiny_model_dir("llama"), "--serve-args", SERVE_ARGS, *WORKLOAD,
                   "--batch-sizes", "1", "4", "--num-prefill-prompts", "2", "--num-decode-steps", "3",
                   "--num-instances", "3", "--result-file", str(result_file)])
    assert status == 0
    printed = capsys.readouterr().out
    assert "rho_max = 2d / (s + 2d)" in printed and "1P2D: min(" in printed and "2P1D: min(" in printed
    measurement = json.loads(result_file.read_text())["measurement"]
    assert len(measurement["prefill_seconds"]) == 2 and set(measurement["step_seconds"]) == {"1", "4"}
    assert f"recommended for 3 instances: {measurement['recommended']}" in printed


@pytest.mark.slow
def test_bench_pd_sweeps_real_splits_through_the_proxy(tiny_model_dir, tmp_path, capsys):
    result_file = tmp_path / "sweep.json"
    status = main(["bench", "pd", "--model", tiny_model_dir("llama"), "--serve-args", SERVE_ARGS, *WORKLOAD,
                   "--sweep", "--skip-measure", "--num-prompts", "4", "--request-rate", "inf",
                   "--ttft-slo-ms", "60000", "--tpot-slo-ms", "60000", "--result-file", str(result_file)])
    assert status == 0
    sweep = json.loads(result_file.read_text())["sweep"]
    assert set(sweep) == {"1P1D", "2 colocated"}
    assert all(summary["completed"] == 4 and summary["failed"] == 0 for summary in sweep.values())
    assert "| 1P1D | 4 / 0 |" in capsys.readouterr().out
