"""`pagedserve serve` flags (kept free of heavy imports so `pagedserve --help` stays fast)."""
from __future__ import annotations

import argparse

API_KEY_ENV = "PAGEDSERVE_API_KEY"
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_WAITING_REQUESTS = 1024


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, local only)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--api-key", default=None,
                       help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; none when unset)")
    group.add_argument("--served-model-name", action="append", default=None,
                       help="name(s) clients use in 'model' (repeatable; default: the --model value)")
    group.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                       help="engine requests allowed to wait beyond --max-num-seqs before new ones get 429")
    group.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help="largest accepted request body (bigger ones get 413)")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests may run after SIGTERM/SIGINT before they are aborted")
    group.add_argument("--engine-death-exit-delay", type=float, default=2.0,
                       help="seconds /health answers 503 after the engine died, before the server exits 1")
    group.add_argument("--engine-startup-timeout", type=float, default=600.0)
    group.add_argument("--uvicorn-log-level", default="warning")
    group.add_argument("--access-log", action="store_true", help="log every HTTP request")
    group.add_argument("--enable-request-id-headers", action="store_true",
                       help="add X-Request-Id to every response (the request's own header, else a random id)")
    tools = parser.add_argument_group("tool calling")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='allow tool_choice "auto" (the default of requests with tools): the model decides and '
                            "--tool-call-parser finds its calls")
    # The names are checked by ToolCallingConfig (importing the registry here would slow `pagedserve --help`).
    tools.add_argument("--tool-call-parser", default=None,
                       help="the model's tool call format: hermes, qwen3, qwen3_coder (also 'qwen3_xml'), "
                            "llama3_json, llama4_json, deepseek_v3 (also 'deepseek'), deepseek_v31")
