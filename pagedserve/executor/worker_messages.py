"""Messages between an executor and its worker processes, and their msgpack codec.

Scheduler outputs go down, the driver rank's ModelRunnerOutput comes back. Everything is msgpack
made by msgspec from the engine's own dataclasses — never pickle — so a peer can only make the other
side build these types.
"""
from __future__ import annotations

from typing import Union

import msgspec

from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


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


class StepResult(msgspec.Struct, tag="result", kw_only=True):
    output: ModelRunnerOutput


class WorkerFailure(msgspec.Struct, tag="failure", kw_only=True):
    rank: int
    message: str


ToWorker = Union[ExecuteModel, ShutdownWorker]
FromWorker = Union[WorkerReady, StepResult, WorkerFailure]


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
