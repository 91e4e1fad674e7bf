"""EngineCoreClient: start the engine process and talk to it over ZeroMQ (server side, asyncio).

The client binds two IPC sockets in a private temporary folder (the engine connects to them), starts
`python -m pagedserve.engine.engine_core_proc` as a child with the engine keyword arguments as JSON,
and waits for EngineReady. Messages are msgspec/msgpack (see messages.py).

Process death is watched directly (`wait_for_exit`), not inferred from silence: a busy engine may
legitimately be quiet for a long step.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import shutil
import sys
import tempfile
from typing import Any

import zmq
import zmq.asyncio

from pagedserve.core.request import Request, RequestStatus
from pagedserve.engine.messages import (AbortRequests, AddRequests, EngineFailure, EngineOutput, EngineReady,
                                        MessageCodec, UtilityCall, UtilityResult)

logger = logging.getLogger(__name__)


class EngineUnreachableError(RuntimeError):
    """A message could not be sent: the engine process is not connected (it exited or was killed)."""


class EngineStartError(RuntimeError):
    """The engine process failed to start (bad model, not enough memory, crashed while loading)."""


class EngineCoreClient:
    """One engine process and the two sockets to it. Create with `await EngineCoreClient.start(...)`."""

    def __init__(self, engine_kwargs: dict[str, Any], log_level: str = "WARNING") -> None:
        self.engine_kwargs = dict(engine_kwargs)
        json.dumps(self.engine_kwargs)  # Fail here, not in the child, when a value cannot travel.
        self.log_level = log_level
        self.codec = MessageCodec()
        self.socket_dir = tempfile.mkdtemp(prefix="pagedserve-zmq-")
        self.input_address = f"ipc://{os.path.join(self.socket_dir, 'input')}"
        self.output_address = f"ipc://{os.path.join(self.socket_dir, 'output')}"
        self.context = zmq.asyncio.Context()
        self.input_socket = self.context.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        # No high-water mark: a send never waits while the engine is connected (it only waits when the
        # engine is gone, which `_send` turns into an error instead of a hang).
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.bind(self.input_address)
        self.output_socket = self.context.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        self.output_socket.bind(self.output_address)
        self.process: asyncio.subprocess.Process | None = None
        self.ready: EngineReady | None = None
        self._call_ids = itertools.count()
        self._is_closed = False

    @classmethod
    async def start(cls, engine_kwargs: dict[str, Any], log_level: str = "WARNING",
                    startup_timeout: float = 600.0) -> "EngineCoreClient":
        client = cls(engine_kwargs, log_level)
        try:
            await client._spawn(startup_timeout)
        except BaseException:
            await client.shutdown(timeout=2.0)
            raise
        return client

    async def _spawn(self, startup_timeout: float) -> None:
        command = [sys.executable, "-m", "pagedserve.engine.engine_core_proc", "--input", self.input_address,
                   "--output", self.output_address, "--engine-kwargs", json.dumps(self.engine_kwargs),
                   "--parent-pid", str(os.getpid()), "--log-level", self.log_level]
        self.process = await asyncio.create_subprocess_exec(*command, stdin=asyncio.subprocess.DEVNULL)
        receive = asyncio.ensure_future(self.output_socket.recv())
        exited = asyncio.ensure_future(self.process.wait())
        try:
            done, _ = await asyncio.wait({receive, exited}, timeout=startup_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            for future in (receive, exited):
                if not future.done():
                    future.cancel()
        if receive in done:
            message = self.codec.decode_output(receive.result())
            if isinstance(message, EngineReady):
                self.ready = message
                return
            if isinstance(message, EngineFailure):
                raise EngineStartError(f"the engine process failed to start: {message.message}")
            raise EngineStartError(f"the engine process sent {type(message).__name__} before EngineReady")
        if exited in done:
            raise EngineStartError(f"the engine process exited with status {exited.result()} while starting")
        raise EngineStartError(f"the engine process was not ready within startup_timeout={startup_timeout} s")

    # --------------------------------------------------------------------------------- messages
    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def is_alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def _send(self, data: bytes) -> None:
        """Send without ever blocking; raises EngineUnreachableError when the engine is not connected."""
        if self._is_closed:
            raise EngineUnreachableError("the engine client is closed")
        try:
            await self.input_socket.send(data, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise EngineUnreachableError("the engine process is not connected (it has exited)") from None

    async def add_requests(self, requests: list[Request]) -> None:
        await self._send(self.codec.encode(AddRequests(requests=requests)))

    async def abort_requests(self, request_ids: list[str],
                             status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        if request_ids:
            await self._send(self.codec.encode(AbortRequests(request_ids=request_ids, status=status)))

    def next_call_id(self) -> int:
        return next(self._call_ids)

    async def send_utility_call(self, method: str, call_id: int | None = None) -> int:
        """Send a UtilityCall; its UtilityResult comes back through `receive_output` with this call id."""
        call_id = self.next_call_id() if call_id is None else call_id
        await self._send(self.codec.encode(UtilityCall(call_id=call_id, method=method)))
        return call_id

    async def receive_output(self) -> EngineOutput:
        return self.codec.decode_output(await self.output_socket.recv(copy=True))

    async def wait_for_exit(self) -> int:
        assert self.process is not None
        return await self.process.wait()

    # --------------------------------------------------------------------------------- shutdown
    async def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the engine to stop, then SIGTERM, then SIGKILL; always reaps the child and removes sockets."""
        if self._is_closed:
            return
        process = self.process
        if process is not None and process.returncode is None:
            try:
                await self.send_utility_call("shutdown")
                await asyncio.wait_for(process.wait(), timeout=timeout)
            except (asyncio.TimeoutError, zmq.ZMQError, EngineUnreachableError):
                pass
            for send_signal, wait in ((process.terminate, timeout), (process.kill, None)):
                if process.returncode is not None:
                    break
                try:
                    send_signal()
                except ProcessLookupError:
                    break
                try:
                    await asyncio.wait_for(process.wait(), timeout=wait)
                except asyncio.TimeoutError:
                    continue
        self._is_closed = True
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.context.term()
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def utility_result_value(result: UtilityResult) -> Any:
    """The value of a UtilityResult, raising RuntimeError when the engine answered with an error."""
    if result.error is not None:
        raise RuntimeError(result.error)
    return result.result
