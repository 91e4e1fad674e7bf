"""Messages between an executor and its worker processes, and their msgpack codec.

Scheduler outputs go down, the driver rank's ModelRunnerOutput comes back. Everything is msgpack
made by msgspec from the engine's own dataclasses — never pickle — so a peer can only make the other
side build these types.

The step protocol ('mp' and 'ray' alike): every rank answers every step, in order — the output rank
with StepResult, the others with StepDone ('ray': the finished call itself) — or with StepFailed when
its step raised. A rank that sent StepFailed runs nothing more until the executor resumes it
(ResumeSteps): a peer may still be inside a collective of the failed step, and a new step's
collective would pair with it. The executor resumes the failed ranks, and fails only that step's
batch, once every rank has answered the step; a rank that does not answer (it waits in a collective
for the failed rank) makes the failure fatal. See `answer_step` and the executors.
"""
from __future__ import annotations

import traceback
from typing import Any, Union

import msgspec
import torch.distributed

from pagedserve.core.scheduler_output import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput


class ExecuteModel(msgspec.Struct, tag="execute", kw_only=True):
    scheduler_output: SchedulerOutput


class ShutdownWorker(msgspec.Struct, tag="shutdown", kw_only=True):
    pass


class WorkerReady(msgspec.Struct, tag="ready", kw_only=True):
    rank: int
    pid: int
    num_kv_blocks: int
    kv_cache_bytes: int
    attention_backend: str
    # Checkpoint bytes this rank materialised while loading (sharded loading reads only its slices).
    weight_bytes_read: int
    # Parameters this rank holds (its TP shard of its pipeline stage's layers), as elements and bytes.
    num_parameters: int = 0
    parameter_bytes: int = 0
    # The port this rank's KV connector serves its blocks on (0: none).
    kv_transfer_port: int = 0


class ResumeSteps(msgspec.Struct, tag="resume", kw_only=True):
    """To a rank held after its StepFailed: every rank answered the failed step, run the next ones."""


class StepResult(msgspec.Struct, tag="result", kw_only=True):
    """The output rank's answer to a step."""

    output: ModelRunnerOutput


class StepDone(msgspec.Struct, tag="done", kw_only=True):
    """Another rank's answer to a step: it finished the step (its output is the output rank's), with its KV
    connector's report when that has news (the executor aggregates every rank's: kv_output_aggregator.py)."""

    kv_connector_output: KVConnectorOutput | None = None


class StepFailed(msgspec.Struct, tag="step_failed", kw_only=True):
    """A rank's answer to a step that raised: only that step's batch fails. The rank is held (runs no
    further step) until it receives ResumeSteps."""

    rank: int
    message: str  # the worker's traceback


class WorkerFailure(msgspec.Struct, tag="failure", kw_only=True):
    """The worker cannot go on (start-up failed, or a collective broke); it exits after sending this."""

    rank: int
    message: str


ToWorker = Union[ExecuteModel, ShutdownWorker, ResumeSteps]
FromWorker = Union[WorkerReady, StepResult, StepDone, StepFailed, WorkerFailure]

STEP_DONE = StepDone()


def answer_step(worker: Any, scheduler_output: SchedulerOutput, rank: int,
                is_output_rank: bool) -> StepResult | StepDone | StepFailed:
    """Run one step on this rank's `worker` and return the rank's answer to it.

    An exception of the step becomes StepFailed (the caller then holds the rank until ResumeSteps).
    A torch.distributed error is raised instead: the collective it broke leaves the ranks' communicators
    in an unknown state, so the worker must stop (the executor treats that as fatal).
    """
    try:
        output = worker.execute_model(scheduler_output)
    except torch.distributed.DistError:
        raise
    except Exception:
        return StepFailed(rank=rank, message=traceback.format_exc())
    if is_output_rank:
        return StepResult(output=output)
    connector_output = output.kv_connector_output
    return STEP_DONE if connector_output is None or connector_output.is_empty \
        else StepDone(kv_connector_output=connector_output)


def describe_step_failures(failures: list[StepFailed], world_size: int) -> str:
    """The message of a failed step: which ranks raised, and the first one's traceback."""
    ranks = sorted(failure.rank for failure in failures)
    first = min(failures, key=lambda failure: failure.rank)
    which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
    return f"the model step raised on worker {which} (world of {world_size}):\n{first.message}"


# Why the executors do not survive a failed step with pipeline parallelism: a stage sends its activations
# without waiting for the next stage to receive them, so a stage that failed before its receive leaves a
# message its next step would read as its own.
PIPELINE_STEP_FAILURE_IS_FATAL = ("with pipeline parallelism a failed step is fatal: a stage that failed before "
                                  "receiving the previous stage's activations would read them in its next step")


class WorkerCodec:
    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._to_worker = msgspec.msgpack.Decoder(ToWorker)
        self._from_worker = msgspec.msgpack.Decoder(FromWorker)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode_to_worker(self, data: bytes) -> ToWorker:
        return self._to_worker.decode(data)

    def decode_from_worker(self, data: bytes) -> FromWorker:
        return self._from_worker.decode(data)
