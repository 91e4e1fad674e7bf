"""UniProcExecutor: one worker in the engine's own process.

Steps submitted with `execute_model_async` run on one background thread (a single-thread pool, so
they run one at a time, in submission order); the engine thread schedules the next step meanwhile.
The thread starts with the first asynchronous step and is joined on shutdown.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from pagedserve.config.engine import EngineConfig
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.executor.abstract import Executor
from pagedserve.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.worker = Worker(config)
        self.runtime_info = self.worker.runtime_info
        self._step_thread: ThreadPoolExecutor | None = None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> "Future[ModelRunnerOutput]":
        if self.worker is None:
            raise RuntimeError("the executor is shut down")
        if self._step_thread is None:
            self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-step")
        return self._step_thread.submit(self.worker.execute_model, scheduler_output)

    def shutdown(self) -> None:
        if self._step_thread is not None:
            # Steps not started yet are cancelled; a running one finishes first (torch cannot be interrupted).
            self._step_thread.shutdown(wait=True, cancel_futures=True)
            self._step_thread = None
        if self.worker is not None:
            self.worker.shutdown()
        self.worker = None  # type: ignore[assignment]
