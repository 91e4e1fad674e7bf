"""The proxy's SSE relay gives back its upstream stream (the instance's in-flight count and the connection to D)
on every path: a finished stream, and a client that disconnects before the first byte, when Starlette never
starts the body iterator (pagedserve/proxy/pd_proxy.py RelayResponse)."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.requests import ClientDisconnect

from pagedserve.proxy.instance_pool import DECODE, Instance
from pagedserve.proxy.pd_proxy import RelayResponse, _UpstreamStream

EVENT = "data: {}\n\n"


class _Upstream(httpx.AsyncByteStream):
    """An upstream body that records whether it was closed."""

    def __init__(self) -> None:
        self.is_closed = False

    async def __aiter__(self):
        yield EVENT.encode()

    async def aclose(self) -> None:
        self.is_closed = True


def _relay() -> tuple[RelayResponse, Instance, _Upstream, list[str]]:
    instance = Instance(url="http://127.0.0.1:1", role=DECODE, num_in_flight=1)
    upstream = _Upstream()
    started: list[str] = []

    async def events():
        started.append("started")
        yield EVENT

    return RelayResponse(events(), _UpstreamStream(instance, httpx.Response(200, stream=upstream))), instance, \
        upstream, started


async def _never_disconnects() -> dict:
    await asyncio.sleep(3600)
    return {"type": "http.disconnect"}


def test_a_finished_stream_releases_its_instance_once():
    relay, instance, upstream, started = _relay()
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(relay({"type": "http", "asgi": {"spec_version": "2.4"}}, _never_disconnects, send))
    assert started and b"".join(m.get("body", b"") for m in sent) == EVENT.encode()
    assert instance.num_in_flight == 0 and upstream.is_closed


@pytest.mark.parametrize("spec_version", ["2.4", "2.0"])
def test_a_client_gone_before_the_first_byte_releases_its_instance(spec_version):
    relay, instance, upstream, started = _relay()

    async def send(message: dict) -> None:
        if spec_version == "2.4":
            raise OSError("the client went away")  # ASGI >= 2.4: send raises once the client is gone
        await asyncio.sleep(3600)  # older servers: the start message hangs while receive reports the disconnect

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def call() -> None:
        await relay({"type": "http", "asgi": {"spec_version": spec_version}}, receive, send)

    if spec_version == "2.4":
        with pytest.raises(ClientDisconnect):
            asyncio.run(call())
    else:
        asyncio.run(call())
    assert not started  # the body iterator never ran: only RelayResponse could release the stream
    assert instance.num_in_flight == 0 and upstream.is_closed
