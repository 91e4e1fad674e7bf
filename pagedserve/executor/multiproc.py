"""MultiprocExecutor ('mp'): one worker process per rank of the engine's TP x PP world.

Start: every worker is a fork of a fork server that imported the worker's modules once (worker_start.py; no
forked kernel state: the fork server never runs one; 'spawn' where there is no fork server), joins a
torch.distributed world through a TCP store on a free loopback port, builds its shard of the model and
its KV cache, and reports WorkerReady. Per step: the SchedulerOutput is msgpack-encoded once and the
same bytes are written to every worker's pipe (a local OS pipe, raw bytes: nothing is pickled); the
output rank — the first TP rank of the last pipeline stage, rank 0 without pipeline parallelism — sends
back the ModelRunnerOutput (all ranks of that stage hold identical sampled tokens; earlier stages do not
sample).

Every rank answers every step (the others with a few-byte StepDone), so the executor knows each rank
finished it. A step that raises in a worker is answered with StepFailed and held there (worker_messages.py):
once every rank has answered that step, the failed ranks are resumed and the step's future raises
WorkerStepError, which fails only that batch — as under 'uni'. A rank that does not answer within
PEER_STEP_GRACE_S waits in a collective for the failed rank: that, and any failed step with pipeline
parallelism, is fatal.

Death: the executor waits on the pipes together with every worker's process sentinel, so a worker that
dies (or cannot go on: WorkerFailure) turns into FatalExecutorError within milliseconds, and the
survivors — possibly blocked in a collective — are killed. No worker outlives its executor: normal
shutdown, garbage collection of the LLM and interpreter exit all run the same reaper (weakref.finalize),
and a worker whose parent vanishes sees its pipe close and exits.
"""
from __future__ import annotations

import logging
import os
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from pagedserve.config.engine import EngineConfig
from pagedserve.config.parallel import ParallelConfig
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.distributed.worker_init import free_loopback_port
from pagedserve.executor.abstract import Executor, FatalExecutorError, WorkerStepError
from pagedserve.executor.worker_start import run_in_environment, worker_context
from pagedserve.executor.worker_messages import (PIPELINE_STEP_FAILURE_IS_FATAL, STEP_DONE, ExecuteModel,
                                                 ResumeSteps, ShutdownWorker, StepDone, StepFailed,
                                                 StepResult, WorkerCodec, WorkerFailure, WorkerReady,
                                                 answer_step, describe_step_failures)
from pagedserve.kv_transfer.kv_output_aggregator import KVOutputAggregator
from pagedserve.worker.worker import RuntimeInfo

logger = logging.getLogger(__name__)

# Building the model can take a while on a busy machine; a step waits as long as it needs (deaths are
# noticed through the sentinels, not through this timeout).
STARTUP_TIMEOUT_S = 300.0
SHUTDOWN_GRACE_S = 5.0
# After a rank answers a step with StepFailed, how long the other ranks may take to answer that step.
# What is left of a step without the failed rank is collective-free (milliseconds); a rank still
# without an answer after this waits in a collective for the failed rank, and never will answer.
PEER_STEP_GRACE_S = 30.0
# A step sent while earlier steps are in flight must fit in the pipe's socket buffer (Linux: ~200 KiB).
MAX_STEP_BYTES_AHEAD = 64 * 1024


def worker_threads(world_size: int) -> int:
    """Intra-op threads per worker: the ranks share the machine's cores."""
    return max(1, (os.cpu_count() or 1) // world_size)


def output_rank(parallel_config: ParallelConfig) -> int:
    """The rank whose ModelRunnerOutput the engine gets: TP rank 0 of PCP rank 0 of the last pipeline stage (ranks
    are ordered (pp_rank * pcp_size + pcp_rank) * tp_size + tp_rank, distributed/parallel_state.py; the PCP ranks
    sample alike)."""
    return parallel_config.world_size_per_engine - parallel_config.tensor_parallel_size \
        * parallel_config.prefill_context_parallel_size


class _StepFuture(Future):
    """A step's future that, when waited on, reads step results from the pipes until it is done."""

    def __init__(self, resolve_oldest: Callable[[], None]) -> None:
        super().__init__()
        self._resolve_oldest = resolve_oldest

    def result(self, timeout: float | None = None) -> Any:
        while not self.done():
            self._resolve_oldest()
        return super().result(timeout)


def run_worker_process(config: EngineConfig, rank: int, init_method: str, conn: Connection) -> None:
    """Entry point of one worker process: build the Worker, then serve steps until told to stop."""
    codec = WorkerCodec()
    is_output_rank = rank == output_rank(config.parallel_config)
    torch.set_num_threads(worker_threads(config.parallel_config.world_size_per_engine))
    try:
        from pagedserve.model_loader.checkpoint_slice import bytes_read
        from pagedserve.worker.worker import Worker

        worker = Worker(config, rank=rank, distributed_init_method=init_method)
        info = worker.runtime_info
        parameters = list(worker.model_runner.model.parameters())
        conn.send_bytes(codec.encode(WorkerReady(
            rank=rank, pid=os.getpid(), num_kv_blocks=info.num_kv_blocks, kv_cache_bytes=info.kv_cache_bytes,
            attention_backend=info.attention_backend, weight_bytes_read=bytes_read(),
            num_parameters=sum(p.numel() for p in parameters),
            parameter_bytes=sum(p.numel() * p.element_size() for p in parameters),
            kv_transfer_port=info.kv_transfer_port)))
        step_done = codec.encode(STEP_DONE)  # the same bytes answer every step a non-output rank finishes
        is_held = False  # after a StepFailed, until ResumeSteps: run nothing (a peer may be in a collective)
        held_steps: deque[ExecuteModel] = deque()  # steps that arrived while held, in order
        while True:
            if held_steps and not is_held:
                message = held_steps.popleft()
            else:
                message = codec.decode_to_worker(conn.recv_bytes())
            if isinstance(message, ShutdownWorker):
                worker.shutdown()
                break
            if isinstance(message, ResumeSteps):
                is_held = False
                continue
            if is_held:
                held_steps.append(message)
                continue
            answer = answer_step(worker, message.scheduler_output, rank, is_output_rank)
            is_held = isinstance(answer, StepFailed)
            conn.send_bytes(step_done if answer is STEP_DONE else codec.encode(answer))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the executor is gone: nothing to report to
    except BaseException:
        try:
            conn.send_bytes(codec.encode(WorkerFailure(rank=rank, message=traceback.format_exc())))
        except OSError:
            pass
        raise SystemExit(1)
    finally:
        if torch.distributed.is_initialized():
            try:
                torch.distributed.destroy_process_group()
            except Exception:  # a peer may already be gone
                pass


def _reap_workers(processes: list[Any], conns: list[Connection], codec: WorkerCodec) -> None:
    """Stop every worker: ask politely, then terminate, then kill; always join (no zombies)."""
    shutdown = codec.encode(ShutdownWorker())
    for process, conn in zip(processes, conns):
        if process.is_alive():
            try:
                conn.send_bytes(shutdown)
            except OSError:
                pass
    for process in processes:
        process.join(SHUTDOWN_GRACE_S)
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(SHUTDOWN_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join()
    for conn in conns:
        conn.close()


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.world_size = config.parallel_config.world_size_per_engine
        self.output_rank = output_rank(config.parallel_config)
        self.codec = WorkerCodec()
        self.is_dead = False
        # Messages read from each rank and not consumed yet, oldest first (ranks answer steps in order).
        self._pending: dict[int, deque[Any]] = {rank: deque() for rank in range(self.world_size)}
        # Futures of steps sent but not read back yet (execute_model_async), oldest first.
        self._unresolved_steps: deque[_StepFuture] = deque()
        hf_config = config.model_config.hf_config
        context = worker_context(type(hf_config).__module__ if hf_config is not None else None)
        init_method = f"tcp://127.0.0.1:{free_loopback_port()}"
        self.processes: list[Any] = []
        self.conns: list[Connection] = []
        # Registered before the first spawn, so a failure half way through still reaps what started.
        self._finalizer = weakref.finalize(self, _reap_workers, self.processes, self.conns, self.codec)
        for rank in range(self.world_size):
            parent_end, child_end = context.Pipe(duplex=True)
            process = context.Process(target=run_in_environment,
                                      args=(dict(os.environ), run_worker_process, config, rank, init_method,
                                            child_end),
                                      name=f"pagedserve-worker-{rank}", daemon=True)
            process.start()
            child_end.close()  # only the child holds it now: its death closes the pipe
            self.processes.append(process)
            self.conns.append(parent_end)
        self._rank_of_conn = {id(conn): rank for rank, conn in enumerate(self.conns)}
        try:
            ready = [self._receive(rank, STARTUP_TIMEOUT_S) for rank in range(self.world_size)]
        except BaseException:
            self.shutdown()
            raise
        for message in ready:
            if not isinstance(message, WorkerReady):
                self.shutdown()
                raise FatalExecutorError(f"worker sent {type(message).__name__} instead of WorkerReady")
        self.worker_pids = [message.pid for message in ready]
        self.weight_bytes_read = [message.weight_bytes_read for message in ready]
        self.parameter_bytes = [message.parameter_bytes for message in ready]
        self.kv_cache_bytes = [message.kv_cache_bytes for message in ready]
        self.num_parameters = [message.num_parameters for message in ready]
        self.runtime_info = RuntimeInfo(num_kv_blocks=ready[0].num_kv_blocks, kv_cache_bytes=ready[0].kv_cache_bytes,
                                        attention_backend=ready[0].attention_backend,
                                        kv_transfer_port=ready[0].kv_transfer_port,
                                        kv_transfer_ports=tuple(message.kv_transfer_port for message in ready))
        # Every rank's KV connector reports its own shard: one report a step for the scheduler (None: no connector).
        self.kv_output_aggregator = (KVOutputAggregator(self.world_size)
                                     if config.kv_transfer_config is not None else None)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step (after any still in flight); a step that raised in a worker raises WorkerStepError."""
        return self.execute_model_async(scheduler_output).result()

    @property
    def max_concurrent_batches(self) -> int:
        """Pipeline parallel: up to one micro-batch per stage in flight, so a stage can run the next
        batch while later stages finish the previous one."""
        return max(super().max_concurrent_batches, self.config.parallel_config.pipeline_parallel_size)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> "Future[ModelRunnerOutput]":
        """Send the step to every worker now; its future resolves when the output rank's StepResult is
        read. Workers run messages in order, so answers arrive in submission order; they are read by
        whoever waits on a future (no reader thread), oldest first. A step that raised in a worker fails
        its own future only (WorkerStepError); a fatal failure fails every future in flight."""
        if self.is_dead:
            raise FatalExecutorError("the multiprocess executor is shut down after a worker failure")
        data = self.codec.encode(ExecuteModel(scheduler_output=scheduler_output))
        if len(data) > MAX_STEP_BYTES_AHEAD:
            # A write that may not fit in the socket buffer must not wait on a worker that is itself
            # blocked writing a large result nobody reads: collect the steps in flight first.
            while self._unresolved_steps:
                self._resolve_oldest_step()
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except OSError:
                self._fail(f"worker rank {rank} is gone (its pipe is closed)")
        future = _StepFuture(self._resolve_oldest_step)
        self._unresolved_steps.append(future)
        return future

    def _resolve_oldest_step(self) -> None:
        try:
            if self.is_dead:
                raise FatalExecutorError("the multiprocess executor is shut down after a worker failure")
            output = self._collect_step()
        except WorkerStepError as error:  # this step's batch only: the steps after it run on
            self._unresolved_steps.popleft().set_exception(error)
            return
        except BaseException as error:  # the workers are gone: every step in flight fails with it
            while self._unresolved_steps:
                self._unresolved_steps.popleft().set_exception(error)
            return
        self._unresolved_steps.popleft().set_result(output)

    def _collect_step(self) -> ModelRunnerOutput:
        """Every rank's answer to the oldest step not collected yet; the output rank's ModelRunnerOutput.

        After a StepFailed the other ranks get PEER_STEP_GRACE_S to answer the same step; when all have,
        the failed ranks are resumed and WorkerStepError is raised (only this step's batch fails).
        """
        answers: list[Any] = [None] * self.world_size
        failures: list[StepFailed] = []
        deadline: float | None = None
        while True:
            for rank in range(self.world_size):
                if answers[rank] is None and self._pending[rank]:
                    answer = answers[rank] = self._pending[rank].popleft()
                    if isinstance(answer, StepFailed):
                        failures.append(answer)
                        if deadline is None:
                            deadline = time.monotonic() + PEER_STEP_GRACE_S
                    elif not isinstance(answer, (StepResult, StepDone)):
                        self._fail(f"worker rank {rank} sent {type(answer).__name__} instead of a step answer")
            missing = [rank for rank, answer in enumerate(answers) if answer is None]
            if not missing:
                break
            if deadline is not None and time.monotonic() >= deadline:
                self._fail(f"worker rank(s) {missing} did not finish the step within {PEER_STEP_GRACE_S:.0f} s "
                           f"after it failed elsewhere (they wait in a collective for a failed rank): the "
                           f"workers are out of step, the engine cannot continue\n"
                           f"{describe_step_failures(failures, self.world_size)}")
            self._read_messages(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if failures:
            self._step_failed(failures)
        result = answers[self.output_rank]
        if not isinstance(result, StepResult):
            self._fail(f"worker rank {self.output_rank} sent {type(result).__name__} instead of a step result")
        if self.kv_output_aggregator is not None:
            result.output.kv_connector_output = self.kv_output_aggregator.aggregate(
                [answer.output.kv_connector_output if isinstance(answer, StepResult) else answer.kv_connector_output
                 for answer in answers])
        return result.output

    def _step_failed(self, failures: list[StepFailed]) -> None:
        """Every rank answered a step that failed on some: resume the held ranks, raise WorkerStepError."""
        message = describe_step_failures(failures, self.world_size)
        if self.config.parallel_config.pipeline_parallel_size > 1:
            self._fail(f"{message}\n{PIPELINE_STEP_FAILURE_IS_FATAL}")
        resume = self.codec.encode(ResumeSteps())
        for failure in failures:
            try:
                self.conns[failure.rank].send_bytes(resume)
            except OSError:
                self._fail(self._death_message(failure.rank))
        raise WorkerStepError(message)

    def _receive(self, rank: int, timeout: float | None) -> Any:
        """The next message from worker `rank` (start-up), watching every worker for death or failure
        meanwhile; messages other ranks send meanwhile (start-up reports arrive in any order) are kept."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._pending[rank]:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._read_messages(remaining):
                self._fail(f"worker rank {rank} did not answer within {timeout:.0f} s")
        return self._pending[rank].popleft()

    def _read_messages(self, timeout: float | None) -> bool:
        """Wait up to `timeout` seconds (None: as long as it takes) for any worker's messages or death, and
        queue the messages per rank. False when nothing happened in time. A death, or a WorkerFailure, is
        fatal at once (after the dead worker's last messages are read)."""
        sentinels = {process.sentinel: index for index, process in enumerate(self.processes)}
        ready = wait([*self.conns, *sentinels], timeout)
        for item in ready:
            if isinstance(item, Connection):
                index = self._rank_of_conn[id(item)]
                try:
                    message = self.codec.decode_from_worker(item.recv_bytes())
                except (EOFError, OSError):
                    self._fail(self._death_message(index))
                if isinstance(message, WorkerFailure):
                    self._fail(self._failure_message(message))
                self._pending[index].append(message)
        for item in ready:
            if not isinstance(item, Connection):
                index = sentinels[item]
                if self.conns[index].poll():
                    continue  # read its last words on the next pass
                self._fail(self._death_message(index))
        return bool(ready)

    def _failure_message(self, failure: WorkerFailure) -> str:
        """A rank's exception is often only the echo of a peer's death (its collective broke): name the
        dead peer first when there is one."""
        for index, process in enumerate(self.processes):
            if index != failure.rank:
                process.join(0.2)
                if process.exitcode is not None:
                    return f"{self._death_message(index)}\n(then rank {failure.rank} failed:\n{failure.message})"
        return f"worker rank {failure.rank} failed:\n{failure.message}"

    def _death_message(self, index: int) -> str:
        process = self.processes[index]
        process.join(0.5)
        return (f"worker rank {index} (pid {process.pid}) died (exit code {process.exitcode}); "
                f"the engine cannot continue")

    def _fail(self, message: str) -> None:
        self.is_dead = True
        logger.error("multiprocess executor: %s", message)
        self.shutdown()
        raise FatalExecutorError(message)

    def shutdown(self) -> None:
        self._finalizer()
