"""Abort work whose HTTP client went away.

Streaming responses are cancelled by Starlette when the client disconnects (their generators then
close the request streams, which aborts the engine requests). A non-streaming handler never writes
until the end, so `run_until_disconnected` races it against the ASGI disconnect message and cancels
it when the client leaves first: its request streams close and the KV blocks are freed at once.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response

T = TypeVar("T")

# nginx's "client closed request": logged, never seen by the (gone) client.
CLIENT_CLOSED_REQUEST = 499


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """The result of `work`, or a 499 Response after cancelling it when the client disconnected first."""
    handler = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        handler.cancel()
        raise
    finally:
        watcher.cancel()
    if handler in done:
        return handler.result()
    handler.cancel()
    await asyncio.gather(handler, return_exceptions=True)
    return Response(status_code=CLIENT_CLOSED_REQUEST)
