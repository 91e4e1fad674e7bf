"""`pagedserve proxy` flags (no heavy imports, so `pagedserve --help` stays fast)."""
from __future__ import annotations

import argparse


def add_proxy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="*", default=[], metavar="URL",
                        help="prefill (KV producer) servers, e.g. http://127.0.0.1:8100; none: every request goes "
                             "whole to one --decode instance (colocated engines behind the same front)")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="decode (KV consumer) servers, or whole engines when no --prefill is given")
    parser.add_argument("--kv-transfer-mode", choices=["pull", "push"], default="pull",
                        help="the instances' PullConnector mode (kv_connector_extra_config.mode): pull (P first, D "
                             "then pulls its blocks) or push (D and P at once, P sends each layer as it computes "
                             "it); the proxy checks every instance's mode at start")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, local only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one upstream request may take (the decode call: its whole stream)")
    parser.add_argument("--connect-timeout", type=float, default=5.0,
                        help="seconds to open a connection to an instance before it counts as down")
    parser.add_argument("--health-interval", type=float, default=2.0,
                        help="seconds between /health probes of every instance (a down one comes back on 200)")
    parser.add_argument("--uvicorn-log-level", default="warning")
