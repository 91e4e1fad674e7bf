"""Executor: runs the workers of one engine (in-process today; multiprocess and Ray plug in here)."""
from __future__ import annotations

from abc import ABC, abstractmethod

from pagedserve.config.engine import EngineConfig
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.worker.worker import RuntimeInfo


class Executor(ABC):
    runtime_info: RuntimeInfo

    @staticmethod
    def create(config: EngineConfig) -> "Executor":
        from pagedserve.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config)

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        ...

    def shutdown(self) -> None:
        return None
