"""The 'mp' executor's workers are forks of a fork server (pagedserve/executor/worker_start.py), and each one takes
the engine process's environment as it is at the worker's start, as a spawned process would."""
from __future__ import annotations

import multiprocessing
import os
from multiprocessing.connection import Connection

import pytest

from pagedserve.executor.worker_start import WORKER_PRELOAD_MODULES, run_in_environment, worker_context

VARIABLE = "PAGEDSERVE_TEST_WORKER_START"


def report_variable(conn: Connection) -> None:
    """A process target (importable in the child): send back the child's value of VARIABLE."""
    conn.send(os.environ.get(VARIABLE))
    conn.close()


def _child_value(context, target, *args) -> str | None:
    parent_end, child_end = context.Pipe(duplex=False)
    process = context.Process(target=target, args=(*args, child_end), daemon=True)
    process.start()
    child_end.close()
    try:
        assert parent_end.poll(120), "the child did not answer"
        return parent_end.recv()
    finally:
        process.join(30)
        parent_end.close()


@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no fork server here")
def test_workers_fork_from_a_fork_server_that_preloads_the_worker_modules() -> None:
    context = worker_context("transformers.models.llama.configuration_llama")
    assert context.get_start_method() == "forkserver"
    assert {"pagedserve.worker.worker", "pagedserve.executor.multiproc"} <= set(WORKER_PRELOAD_MODULES)


def test_a_worker_takes_the_environment_at_its_start(monkeypatch: pytest.MonkeyPatch) -> None:
    context = worker_context(None)
    monkeypatch.setenv(VARIABLE, "before")
    assert _child_value(context, run_in_environment, dict(os.environ), report_variable) == "before"
    # The fork server is running now, with an environment that does not hold the new value.
    monkeypatch.setenv(VARIABLE, "after")
    assert _child_value(context, run_in_environment, dict(os.environ), report_variable) == "after"
    monkeypatch.delenv(VARIABLE)
    assert _child_value(context, run_in_environment, dict(os.environ), report_variable) is None
    if context.get_start_method() == "forkserver":
        # Without run_in_environment a fork holds the fork server's environment: what the wrapper is for.
        assert _child_value(context, report_variable) != "after"
