"""The messages between the server process (AsyncLLM) and the engine process, and their codec.

Everything crossing the ZeroMQ sockets is msgpack produced by msgspec from typed structs: the
engine's own dataclasses (Request, EngineCoreOutput, SchedulerStats, SamplingParams) travel as they
are, wrapped in a tagged envelope. Nothing is ever pickled, so a peer can only make the other side
build these types, never run code.

Directions:
  server -> engine (input socket):  AddRequests | AbortRequests | UtilityCall
  engine -> server (output socket): EngineReady | EngineCoreOutputs | UtilityResult | EngineFailure
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

from pagedserve.core.engine_core_output import EngineCoreOutput, SchedulerStats
from pagedserve.core.request import Request, RequestStatus


class AddRequests(msgspec.Struct, tag="add", kw_only=True):
    """New engine requests (the n children of one user request travel together)."""

    requests: list[Request]


class AbortRequests(msgspec.Struct, tag="abort", kw_only=True):
    """Finish these engine requests with `status` (aborted by a client, or stopped by a stop string)."""

    request_ids: list[str]
    status: RequestStatus = RequestStatus.FINISHED_ABORTED


class UtilityCall(msgspec.Struct, tag="call", kw_only=True):
    """Ask the engine for something outside the step loop; answered by a UtilityResult with call_id.

    Methods: 'ping', 'stats', 'shutdown'.
    """

    call_id: int
    method: str


class EngineReady(msgspec.Struct, tag="ready", kw_only=True):
    """Sent once, when the engine core is built and the step loop is about to start."""

    pid: int
    num_kv_blocks: int
    max_model_len: int
    # The prefill/decode KV connector's engine id and block-server ports (every worker rank's), as the engine
    # process knows them (kv_transfer/kv_transfer_info.py); empty without one.
    kv_transfer_engine_id: str = ""
    kv_transfer_ports: list[int] = []
    # Every DP rank's ({"engine_id", "ports"}, rank order; the two fields above are rank 0's); empty without one.
    kv_transfer_data_parallel_ranks: list[dict[str, Any]] = []


class EngineCoreOutputs(msgspec.Struct, tag="outputs", kw_only=True):
    """One step's outputs plus the scheduler's stats after the step (also sent after aborts)."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    timestamp: float


class UtilityResult(msgspec.Struct, tag="result", kw_only=True):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineFailure(msgspec.Struct, tag="failure", kw_only=True):
    """The engine process is going down because of an error (it sends this, then exits non-zero)."""

    message: str


EngineInput = Union[AddRequests, AbortRequests, UtilityCall]
EngineOutput = Union[EngineReady, EngineCoreOutputs, UtilityResult, EngineFailure]


class MessageCodec:
    """msgpack encoder plus typed decoders for both directions (one per socket end)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._input_decoder = msgspec.msgpack.Decoder(EngineInput)
        self._output_decoder = msgspec.msgpack.Decoder(EngineOutput)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode_input(self, data: bytes) -> EngineInput:
        """Raises msgspec.DecodeError / ValidationError on bytes that are not a valid EngineInput."""
        return self._input_decoder.decode(data)

    def decode_output(self, data: bytes) -> EngineOutput:
        return self._output_decoder.decode(data)
