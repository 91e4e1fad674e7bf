"""The load generator's dataset and statistics (no server; a live run is in test_openai_server.py)."""
from __future__ import annotations

import pytest

from pagedserve.bench.serve import RequestResult, make_requests, meets_slos, parse_goodput, summarize


def test_random_requests_are_seeded_and_in_range():
    first = make_requests(20, "random", None, (4, 9), (2, 5), (10, 50), seed=3)
    again = make_requests(20, "random", None, (4, 9), (2, 5), (10, 50), seed=3)
    assert [r.prompt for r in first] == [r.prompt for r in again]
    assert all(4 <= len(r.prompt) <= 9 and r.prompt_len == len(r.prompt) for r in first)
    assert all(10 <= t < 50 for r in first for t in r.prompt)
    assert all(2 <= r.max_tokens <= 5 for r in first)
    assert [r.prompt for r in make_requests(20, "random", None, (4, 9), (2, 5), (10, 50), seed=4)] != [
        r.prompt for r in first]


def test_file_requests(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text('one\n{"prompt": "two"}\n\n')
    requests = make_requests(5, "file", str(path), (1, 1), (3, 3), (0, 1), seed=0)
    assert len(requests) == 5 and {r.prompt for r in requests} <= {"one", "two"}
    with pytest.raises(ValueError, match="dataset_path"):
        make_requests(1, "file", str(tmp_path / "none"), (1, 1), (1, 1), (0, 1), seed=0)
    with pytest.raises(ValueError, match="input_len_range"):
        make_requests(1, "random", None, (5, 1), (1, 1), (0, 1), seed=0)


def test_summary_percentiles_and_goodput():
    results = [RequestResult(True, prompt_len=10, output_tokens=5, ttft=0.1, e2el=0.5, itl=[0.1] * 4),
               RequestResult(True, prompt_len=10, output_tokens=3, ttft=0.3, e2el=0.5, itl=[0.1, 0.1]),
               RequestResult(False, error="HTTP 500")]
    assert results[0].tpot == pytest.approx(0.1) and results[1].tpot == pytest.approx(0.1)
    summary = summarize(results, duration=2.0, percentiles=[50, 99], slos=parse_goodput(["ttft:200"]))
    assert summary["completed"] == 2 and summary["failed"] == 1 and summary["errors"] == ["HTTP 500"]
    assert summary["request_throughput"] == pytest.approx(1.0)
    assert summary["output_throughput"] == pytest.approx(4.0)
    assert summary["ttft"]["mean"] == pytest.approx(200.0) and summary["ttft"]["p50"] == pytest.approx(200.0)
    assert summary["itl"]["p99"] == pytest.approx(100.0)
    assert summary["goodput_requests_per_s"] == pytest.approx(0.5)  # only the first meets ttft <= 200 ms
    assert not meets_slos(results[2], {})
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput(["latency:5"])
