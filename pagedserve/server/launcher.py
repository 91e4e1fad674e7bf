"""`pagedserve serve`: start the engine process, then uvicorn; shut both down cleanly.

Lifecycle:
  - start: the engine process is started and ready before the port is bound, so a bad model or
    configuration exits non-zero without ever accepting a connection;
  - SIGTERM / SIGINT: /health turns 503 and new requests get 503, the listening socket closes,
    in-flight requests get up to --shutdown-timeout seconds to finish (then they are cancelled,
    which aborts them in the engine), then the engine process is stopped and reaped; exit status 0;
  - engine death: in-flight requests fail at once (503 / an SSE error event), /health answers 503,
    and after --engine-death-exit-delay seconds (time for a load balancer to notice) the server
    stops and exits with status 1.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import uvicorn

from pagedserve.config.tool_calling import ToolCallingConfig
from pagedserve.engine.async_llm import AsyncLLM, EngineDeadError
from pagedserve.engine.stat_loggers import LoggingStatLogger, StatLoggers
from pagedserve.server.api_server import build_app
from pagedserve.server.auth import resolve_api_key
from pagedserve.server.serve_args import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.state import ServerState

logger = logging.getLogger(__name__)

EXIT_ENGINE_DEAD = 1


def default_model_name(model: str | None) -> str:
    if model is None:
        return "smollm2-135m-instruct"
    return model.rstrip("/")


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app when shutdown begins (so /health and admission answer 503)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.server_state_ref = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.server_state_ref.is_shutting_down = True
        super().handle_exit(sig, frame)


async def serve(engine_kwargs: dict[str, Any], *, host: str = "127.0.0.1", port: int = 8000,
                api_key: str | None = None, served_model_names: list[str] | None = None,
                max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
                max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, shutdown_timeout: float = 30.0,
                engine_death_exit_delay: float = 2.0, engine_startup_timeout: float = 600.0,
                log_level: str = "WARNING", uvicorn_log_level: str = "warning", access_log: bool = False,
                tool_calling: ToolCallingConfig | None = None, enable_request_id_headers: bool = False,
                on_serving: Callable[[], None] | None = None) -> int:
    """Run the server until a signal or an engine death; returns the exit status.

    `on_serving` is called just before uvicorn takes over (and owns SIGINT/SIGTERM).
    """
    if not 1 <= port <= 65535:
        raise ValueError(f"port={port} must be in [1, 65535]")
    if max_waiting_requests < 0:
        raise ValueError(f"max_waiting_requests={max_waiting_requests} must be >= 0")
    if shutdown_timeout < 0:
        raise ValueError(f"shutdown_timeout={shutdown_timeout} must be >= 0")
    names = served_model_names or [default_model_name(engine_kwargs.get("model"))]
    metrics = ServerMetrics(names[0])
    # The Prometheus metrics, and vLLM's periodic log line (INFO: shown with --log-level INFO).
    stat_loggers = StatLoggers([metrics, LoggingStatLogger()])
    engine = await AsyncLLM.start(engine_kwargs, stat_logger=stat_loggers, log_level=log_level,
                                  startup_timeout=engine_startup_timeout)
    state = ServerState(engine=engine, served_model_names=names, metrics=metrics,
                        max_waiting_requests=max_waiting_requests, tool_calling=tool_calling or ToolCallingConfig())
    try:
        app = build_app(state, api_key=api_key, max_body_bytes=max_body_bytes,
                        enable_request_id_headers=enable_request_id_headers)
        config = uvicorn.Config(app, host=host, port=port, log_level=uvicorn_log_level, access_log=access_log,
                                lifespan="off", timeout_graceful_shutdown=shutdown_timeout,
                                timeout_keep_alive=5)
        server = _Server(config, state)
        loop = asyncio.get_running_loop()

        def on_engine_dead(error: EngineDeadError) -> None:
            if state.is_shutting_down:
                return  # A signal to the whole process group stopped the engine too: a normal shutdown.
            state.engine_dead_error = error
            logger.error("%s; the server exits in %.1f s", error, engine_death_exit_delay)

            def stop() -> None:
                state.is_shutting_down = True
                server.should_exit = True

            loop.call_later(engine_death_exit_delay, stop)

        engine.on_engine_dead.append(on_engine_dead)
        print(f"pagedserve: serving {names[0]} on http://{host}:{port} (engine pid {engine.engine_pid})",
              file=sys.stderr, flush=True)
        if on_serving is not None:
            on_serving()
        await server.serve()
    finally:
        state.is_shutting_down = True
        await engine.shutdown(timeout=5.0)
    return EXIT_ENGINE_DEAD if state.engine_dead_error is not None else 0


def default_engine_threads_when_serving(num_cores: int | None = None) -> int:
    """Every core on a machine of fewer than 4 cores; else all but one, left to the HTTP process
    (tokenizing, detokenizing, streaming).

    The engine's OpenMP team stalls whenever the front end takes one of its cores, which once made
    2-thread steps slower than 1-thread ones on a 2-core machine. Since the KV cache moved to huge pages
    and the LM head was prepacked (cheaper steps), 2 threads won on 2 cores at both of recipe C's rates
    (TPOT p50 83.1 / 86.7 ms against 111.6 / 122.0 with one; benchmarks/README.md), so small machines use
    every core, like vLLM CPU; from 4 cores on, the front end's core costs the engine at most a quarter.
    """
    num_cores = num_cores or os.cpu_count() or 1
    return num_cores if num_cores < 4 else num_cores - 1


def run_serve(args: argparse.Namespace) -> int:
    """The `pagedserve serve` handler."""
    from pagedserve.config.cli_args import engine_kwargs_from_args

    api_key = resolve_api_key(args.api_key)
    # Checked before anything starts: a bad parser name exits at once.
    tool_calling = ToolCallingConfig(enable_auto_tool_choice=args.enable_auto_tool_choice,
                                     tool_call_parser=args.tool_call_parser)
    # Until uvicorn takes over the signals, SIGTERM stops startup like Ctrl-C does; afterwards uvicorn
    # re-raises the signals it caught, which must then do nothing (the shutdown already happened).
    is_starting = True

    def on_signal(signum: int, frame: Any) -> None:
        if is_starting:
            raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)

    def on_serving() -> None:
        nonlocal is_starting
        is_starting = False

    engine_kwargs = engine_kwargs_from_args(args)
    if engine_kwargs.get("num_cpu_threads") is None:
        engine_kwargs["num_cpu_threads"] = default_engine_threads_when_serving()

    async def main() -> int:
        task = serve(engine_kwargs, host=args.host, port=args.port, api_key=api_key,
                     served_model_names=args.served_model_name, max_waiting_requests=args.max_waiting_requests,
                     max_body_bytes=args.max_body_bytes, shutdown_timeout=args.shutdown_timeout,
                     engine_death_exit_delay=args.engine_death_exit_delay,
                     engine_startup_timeout=args.engine_startup_timeout, log_level=args.log_level,
                     uvicorn_log_level=args.uvicorn_log_level, access_log=args.access_log,
                     tool_calling=tool_calling, enable_request_id_headers=args.enable_request_id_headers,
                     on_serving=on_serving)
        return await task

    try:
        status = asyncio.run(main())
    except KeyboardInterrupt:
        return 130
    return status
