"""The engine process: EngineCore's busy loop behind two ZeroMQ sockets.

Run as `python -m pagedserve.engine.engine_core_proc --input ADDR --output ADDR --engine-kwargs JSON
--parent-pid PID`. The server process (EngineCoreClient) binds both sockets; this process connects:

  input  (PULL): AddRequests | AbortRequests | UtilityCall from the server
  output (PUSH): EngineReady once, then EngineCoreOutputs after every step (and after aborts, so
                 metrics see freed blocks at once), UtilityResults, or an EngineFailure before dying.

The loop never waits on the server: it drains whatever input is queued, runs one step, pushes the
step's outputs and goes on. It blocks only when there is nothing to run. It exits when told to
('shutdown'), on SIGTERM, or when its parent dies (PR_SET_PDEATHSIG plus a parent-pid check), so a
crashed server never leaves an engine behind. SIGINT is ignored: a Ctrl-C in the terminal reaches
the whole process group, and the server decides how the engine stops.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

import zmq

from pagedserve.core.engine_core_output import EngineCoreOutput
from pagedserve.engine.messages import (AbortRequests, AddRequests, EngineCoreOutputs, EngineFailure,
                                        EngineReady, MessageCodec, UtilityCall, UtilityResult)

logger = logging.getLogger(__name__)

# How long the idle loop blocks on the input socket before checking that its parent is still alive.
_IDLE_POLL_MS = 200
_PR_SET_PDEATHSIG = 1


class _ShutdownRequested(Exception):
    """Raised inside the loop to leave it cleanly (a 'shutdown' call or SIGTERM)."""


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGTERM this process when its parent dies; exit now if it already has."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # Not Linux: the parent-pid check in the idle loop still catches an orphaned engine.
    if os.getppid() != parent_pid:
        raise SystemExit(0)


def _kv_transfer_ranks(engine_core: Any) -> list[dict[str, Any]]:
    """Every DP rank's prefill/decode connector as its engine core runs it, in rank order: [{"engine_id": ...,
    "ports": [its worker ranks' block-server ports]}] (one entry for one engine core; [] without a PD connector)."""
    from pagedserve.engine.dp_engine_core import DataParallelEngineCore
    from pagedserve.kv_transfer.kv_transfer_info import pd_connector_config

    cores = engine_core.cores if isinstance(engine_core, DataParallelEngineCore) else [engine_core]
    ranks = []
    for core in cores:
        part = pd_connector_config(core.config.kv_transfer_config)
        if part is None:
            return []
        info = core.runtime_info
        ports = info.kv_transfer_ports or ((info.kv_transfer_port,) if info.kv_transfer_port else ())
        ranks.append({"engine_id": part.engine_id, "ports": [int(port) for port in ports]})
    return ranks


class EngineCoreProc:
    """Owns one EngineCore and the two sockets; `run()` is the busy loop."""

    def __init__(self, engine_kwargs: dict[str, Any], input_address: str, output_address: str,
                 parent_pid: int) -> None:
        self.parent_pid = parent_pid
        self.codec = MessageCodec()
        self.context = zmq.Context()
        self.output_socket = self.context.socket(zmq.PUSH)
        # Outputs already queued are delivered on close for up to 2 s (the final results of a shutdown).
        self.output_socket.setsockopt(zmq.LINGER, 2000)
        self.output_socket.connect(output_address)
        self.input_socket = self.context.socket(zmq.PULL)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.connect(input_address)
        self.engine_kwargs = engine_kwargs
        self.engine_core: Any = None

    def send(self, message: Any) -> None:
        self.output_socket.send(self.codec.encode(message), copy=False)

    def start(self) -> None:
        """Build the EngineCore (loads the model, allocates KV) and announce readiness."""
        from pagedserve.config.engine import EngineConfig
        from pagedserve.engine.dp_engine_core import create_engine_core

        config = EngineConfig.create(**self.engine_kwargs)
        self.engine_core = create_engine_core(config)
        runtime_info = self.engine_core.runtime_info
        kv_transfer_ranks = _kv_transfer_ranks(self.engine_core)
        first = kv_transfer_ranks[0] if kv_transfer_ranks else {"engine_id": "", "ports": []}
        self.send(EngineReady(pid=os.getpid(), num_kv_blocks=int(runtime_info.num_kv_blocks),
                              max_model_len=config.model_config.max_model_len,
                              kv_transfer_engine_id=first["engine_id"], kv_transfer_ports=first["ports"],
                              kv_transfer_data_parallel_ranks=kv_transfer_ranks))

    def handle_input(self, data: bytes) -> None:
        message = self.codec.decode_input(data)
        core = self.engine_core
        if isinstance(message, AddRequests):
            refused = []
            for request in message.requests:
                try:
                    core.add_request(request)
                except ValueError as error:
                    # A request the scheduler refuses (an id still in use, a prompt out of bounds): the front end
                    # checked what it could; this request fails alone, the engine keeps running.
                    logger.error("request %s refused: %s", request.request_id, error)
                    refused.append(EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                                    finish_reason="error", stop_reason=str(error)))
            if refused:
                self.send(EngineCoreOutputs(outputs=refused, stats=core.make_stats(), timestamp=time.monotonic()))
        elif isinstance(message, AbortRequests):
            core.abort_requests(message.request_ids, message.status)
        elif isinstance(message, UtilityCall):
            self.handle_utility(message)

    def handle_utility(self, call: UtilityCall) -> None:
        if call.method == "ping":
            self.send(UtilityResult(call_id=call.call_id, result="pong"))
        elif call.method == "stats":
            self.send(UtilityResult(call_id=call.call_id, result=self.engine_core.make_stats()))
        elif call.method == "shutdown":
            self.send(UtilityResult(call_id=call.call_id, result="bye"))
            raise _ShutdownRequested
        else:
            self.send(UtilityResult(call_id=call.call_id, error=f"method={call.method!r} is not one of "
                                                                 "['ping', 'stats', 'shutdown']"))

    def drain_input(self) -> bool:
        """Handle every queued input message without blocking; True when there was any."""
        handled = False
        while True:
            try:
                data = self.input_socket.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return handled
            self.handle_input(data)
            handled = True

    def run(self) -> None:
        core = self.engine_core
        while True:
            if not core.has_unfinished_requests():
                # Idle: block until input arrives, waking now and then to see whether the parent died.
                if not self.input_socket.poll(_IDLE_POLL_MS):
                    if os.getppid() != self.parent_pid:
                        logger.warning("the server process is gone; the engine exits")
                        return
                    continue
            had_input = self.drain_input()
            stepped = core.has_unfinished_requests()
            outputs = core.step() if stepped else []
            # Stats go with outputs and inputs, and once more when a step leaves the engine idle: a step with no
            # outputs can still free blocks (a KV connector's held blocks released), and the gauges (KV usage,
            # running, waiting) must not stay at their last busy values while nothing runs.
            went_idle = stepped and not core.has_unfinished_requests()
            if outputs or had_input or went_idle:
                self.send(EngineCoreOutputs(outputs=outputs, stats=core.make_stats(), timestamp=time.monotonic()))

    def close(self) -> None:
        if self.engine_core is not None:
            try:
                self.engine_core.shutdown()
            except Exception:  # Shutting down anyway: a failing executor must not keep the process up.
                logger.exception("engine core shutdown failed")
        self.input_socket.close()
        self.output_socket.close()
        self.context.term()


def run_engine_core_proc(engine_kwargs: dict[str, Any], input_address: str, output_address: str,
                         parent_pid: int) -> int:
    """Process entry point; returns the exit status (0 after a requested shutdown)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_sigterm(signum: int, frame: Any) -> None:
        raise _ShutdownRequested

    signal.signal(signal.SIGTERM, on_sigterm)
    _die_with_parent(parent_pid)
    proc = EngineCoreProc(engine_kwargs, input_address, output_address, parent_pid)
    try:
        proc.start()
        proc.run()
        return 0
    except _ShutdownRequested:
        return 0
    except BaseException as error:  # noqa: BLE001 - report any death to the server before exiting
        logger.error("engine process failed: %s", traceback.format_exc())
        try:
            proc.send(EngineFailure(message=f"{type(error).__name__}: {error}"))
        except Exception:
            pass
        return 1
    finally:
        proc.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="pagedserve engine process (started by the server)")
    parser.add_argument("--input", required=True, help="ZeroMQ address of the server's input socket")
    parser.add_argument("--output", required=True, help="ZeroMQ address of the server's output socket")
    parser.add_argument("--engine-kwargs", required=True, help="EngineConfig.create keyword arguments as JSON")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s engine %(name)s: %(message)s")
    return run_engine_core_proc(json.loads(args.engine_kwargs), args.input, args.output, args.parent_pid)


if __name__ == "__main__":
    sys.exit(main())

