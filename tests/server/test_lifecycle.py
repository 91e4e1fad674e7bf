"""Bounded admission (429) and engine death, on a server of its own (this module kills its engine)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from server_engine_settings import ENGINE_ARGS
from server_process import ServerProcess, child_pids, pid_exists

MAX_NUM_SEQS = 2
MAX_WAITING = 1


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    process = ServerProcess(tiny_model_dir("llama"), ENGINE_ARGS + [
        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING),
        "--engine-death-exit-delay", "3"])
    try:
        yield process
    finally:
        process.stop()


def _open_stream(http: httpx.Client, server: ServerProcess, wait_for_first_event: bool, max_tokens: int = 1800):
    """Start a long streaming completion (admitted once the 200 headers are back; a running one has
    also streamed its first event)."""
    request = http.build_request("POST", f"{server.base_url}/v1/completions",
                                 json={"prompt": "keep going", "max_tokens": max_tokens, "ignore_eos": True,
                                       "stream": True})
    response = http.send(request, stream=True)
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    if wait_for_first_event:
        assert next(lines).startswith("data: ")
    return response, lines


def test_overload_gets_429_then_engine_death_fails_fast(server):
    assert server.engine_pid is not None
    with httpx.Client(timeout=60) as http:
        # max_num_seqs running + max_waiting_requests waiting fill the server.
        streams = [_open_stream(http, server, wait_for_first_event=index < MAX_NUM_SEQS)
                   for index in range(MAX_NUM_SEQS + MAX_WAITING)]
        refused = http.post(f"{server.base_url}/v1/completions", json={"prompt": "one more", "max_tokens": 4})
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "1"
        error = refused.json()["error"]
        assert error["code"] == 429 and error["type"] == "RateLimitError"
        assert "max_waiting_requests=1" in error["message"]
        chat_refused = http.post(f"{server.base_url}/v1/chat/completions",
                                 json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat_refused.status_code == 429

        # Kill the engine with streams in flight: they end promptly with an error event, not a hang.
        killed_at = time.monotonic()
        os.kill(server.engine_pid, signal.SIGKILL)
        for response, lines in streams:
            rest = [line for line in lines if line.startswith("data: ")]
            response.close()
            assert rest[-1] == "data: [DONE]"
            assert any('"error"' in line and "engine" in line for line in rest[-3:]), rest[-3:]
        assert time.monotonic() - killed_at < 5.0

        health = http.get(f"{server.base_url}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == 503
        after = http.post(f"{server.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert after.status_code == 503 and "engine" in after.json()["error"]["message"]

    # The server then exits non-zero by itself, leaving no child behind.
    assert server.process.wait(timeout=30) == 1
    assert child_pids(server.process.pid) == []
    assert not pid_exists(server.engine_pid)


def test_bad_model_exits_nonzero_without_children(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(tmp_path / "missing"),
                             "--port", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "missing" in result.stderr


def test_a_rejected_config_stops_the_engine_process_started_alongside(tmp_path):
    """AsyncLLM.start spawns the engine while it validates the configuration itself: a rejected one must
    leave no engine process behind."""
    import asyncio

    from pagedserve.engine.async_llm import AsyncLLM

    before = set(child_pids(os.getpid()))
    with pytest.raises(Exception, match="missing"):
        asyncio.run(AsyncLLM.start(dict(model=str(tmp_path / "missing")), startup_timeout=60))
    deadline = time.monotonic() + 10
    while set(child_pids(os.getpid())) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert set(child_pids(os.getpid())) - before == set()
