"""Shared checks for the executor failure tests: a worker killed mid-generation must surface as
FatalExecutorError promptly (and keep surfacing), and no worker process may outlive its engine."""
from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from pagedserve import SamplingParams
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.executor.abstract import FatalExecutorError


def kill_worker_mid_generation(engine: LLMEngine, pid: int, rank: int, max_seconds: float = 10.0) -> None:
    """Start a generation, SIGKILL `pid` (worker `rank`) after three steps, and assert that the engine
    raises FatalExecutorError naming that rank within `max_seconds`, and again on the next step."""
    engine.add_request("a", {"prompt_token_ids": list(range(10, 40))},
                       SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(FatalExecutorError, match=f"rank {rank}"):
        for _ in range(50):
            engine.step()
    assert time.monotonic() - start < max_seconds
    # Later steps keep failing loudly instead of hanging.
    with pytest.raises(FatalExecutorError):
        engine.step()


def pids_still_running(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """The pids still running (zombies count as gone) after waiting up to `timeout_s` for them to exit."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)
