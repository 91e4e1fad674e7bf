"""Executor: runs the workers of one engine core ('uni' in-process, 'mp' worker processes, 'ray' actors)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future

from pagedserve.config.engine import EngineConfig
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.worker.worker import RuntimeInfo


class FatalExecutorError(RuntimeError):
    """The executor cannot run another step (a worker died or failed); the engine must stop.

    Unlike an ordinary step failure (which fails only that batch), this propagates out of
    EngineCore.step: the workers' state is gone or inconsistent.
    """


class WorkerStepError(RuntimeError):
    """A step raised in a worker process or actor ('mp', 'ray'), and every rank still answered it.

    An ordinary step failure, as under 'uni' (where the worker's own exception propagates): only that
    step's batch fails and the engine goes on. The message holds the worker's traceback (exceptions
    cross the process boundary as text: nothing is pickled).
    """


class Executor(ABC):
    """Runs steps on the workers.

    Steps may be submitted before earlier ones finish (`execute_model_async`, up to
    `max_concurrent_batches` in flight): every executor runs them on each worker in submission order,
    and resolves their futures in that order. The order is what lets the scheduler hand out a decode
    step whose input token (sampled by the step before) it has not seen yet: the worker has.
    """

    config: EngineConfig
    runtime_info: RuntimeInfo

    @staticmethod
    def create(config: EngineConfig) -> "Executor":
        backend = config.parallel_config.executor_backend
        if backend == "ray":
            try:
                from pagedserve.executor.ray_executor import RayExecutor
            except ModuleNotFoundError as error:
                if error.name != "ray":
                    raise
                raise ImportError("distributed_executor_backend='ray' needs the ray package "
                                  "(pip install 'ray>=2.60'); or use 'mp' on one machine") from error

            return RayExecutor(config)
        if backend == "mp":
            from pagedserve.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor(config)
        from pagedserve.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config)

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        ...

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine core may keep in flight: 1 runs one step at a time; 2 with async scheduling
        (step t+1 is scheduled and queued while step t runs). Pipeline parallelism raises it further."""
        return 2 if self.config.scheduler_config.async_scheduling else 1

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> "Future[ModelRunnerOutput]":
        """Submit one step; the future holds its output (or its exception).

        This default runs the step at once, in the caller's thread: executors with a background path
        (a step thread, worker pipes) override it so the caller can schedule the next step meanwhile.
        """
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(self.execute_model(scheduler_output))
        except Exception as error:  # delivered through the future, like a background step's failure
            future.set_exception(error)
        return future

    def shutdown(self) -> None:
        return None
