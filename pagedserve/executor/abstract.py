"""Executor: runs the workers of one engine core ('uni' in-process, 'mp' worker processes, 'ray' actors)."""
from __future__ import annotations

from abc import ABC, abstractmethod

from pagedserve.config.engine import EngineConfig
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.worker.worker import RuntimeInfo


class FatalExecutorError(RuntimeError):
    """The executor cannot run another step (a worker died or failed); the engine must stop.

    Unlike an ordinary step failure (which fails only that batch), this propagates out of
    EngineCore.step: the workers' state is gone or inconsistent.
    """


class Executor(ABC):
    runtime_info: RuntimeInfo

    @staticmethod
    def create(config: EngineConfig) -> "Executor":
        backend = config.parallel_config.executor_backend
        if config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError(f"pipeline_parallel_size={config.parallel_config.pipeline_parallel_size}: the "
                             f"pipeline-parallel forward is not built yet; allowed: 1")
        if backend == "ray":
            raise ValueError("distributed_executor_backend='ray' is not built yet; allowed: 'uni', 'mp'")
        if backend == "mp":
            from pagedserve.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor(config)
        from pagedserve.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config)

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        ...

    def shutdown(self) -> None:
        return None
