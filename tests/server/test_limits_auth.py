"""Auth, body-size and admission limits as units (no engine)."""
from __future__ import annotations

import hashlib

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from pagedserve.server.auth import APIKeyMiddleware, is_key_valid, resolve_api_key
from pagedserve.server.errors import OpenAIError
from pagedserve.server.limits import BodySizeLimitMiddleware, check_admission


async def echo_size(request: Request) -> JSONResponse:
    return JSONResponse({"size": len(await request.body())})


def make_client(api_key: str | None = None, max_body_bytes: int = 100) -> TestClient:
    app = Starlette(routes=[Route("/v1/x", echo_size, methods=["POST"]), Route("/health", echo_size, methods=["POST"])])
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return TestClient(app)


def test_body_size_limit():
    client = make_client()
    assert client.post("/v1/x", content=b"a" * 100).json() == {"size": 100}
    too_large = client.post("/v1/x", content=b"a" * 101)
    assert too_large.status_code == 413 and "100 bytes" in too_large.json()["error"]["message"]

    def chunks():  # no Content-Length: counted while reading
        for _ in range(5):
            yield b"a" * 30

    assert client.post("/v1/x", content=chunks()).status_code == 413


def test_api_key_middleware():
    client = make_client(api_key="secret")
    assert client.post("/v1/x", content=b"").status_code == 401
    assert client.post("/v1/x", content=b"", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.post("/v1/x", content=b"", headers={"Authorization": "Basic secret"}).status_code == 401
    assert client.post("/v1/x", content=b"", headers={"Authorization": "Bearer secret"}).status_code == 200
    assert client.post("/health", content=b"").status_code == 200  # public
    digest = hashlib.sha256(b"k").digest()
    assert is_key_valid("k", digest) and not is_key_valid("k ", digest) and not is_key_valid("", digest)


def test_resolve_api_key(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "from-env")
    assert resolve_api_key(None) == "from-env"
    assert resolve_api_key("flag") == "flag"
    monkeypatch.delenv("PAGEDSERVE_API_KEY")
    assert resolve_api_key(None) is None
    with pytest.raises(ValueError, match="api_key"):
        resolve_api_key("")


def test_admission_bound():
    check_admission(num_engine_requests=3, num_new=1, max_num_seqs=2, max_waiting_requests=2)
    with pytest.raises(OpenAIError) as caught:
        check_admission(num_engine_requests=4, num_new=1, max_num_seqs=2, max_waiting_requests=2)
    assert caught.value.status_code == 429 and caught.value.headers == {"Retry-After": "1"}
    with pytest.raises(OpenAIError) as caught:  # n > 1 counts every sample
        check_admission(num_engine_requests=3, num_new=2, max_num_seqs=2, max_waiting_requests=2)
    assert caught.value.status_code == 429
    with pytest.raises(OpenAIError) as caught:  # can never fit: a client mistake, not overload
        check_admission(num_engine_requests=0, num_new=5, max_num_seqs=2, max_waiting_requests=2)
    assert caught.value.status_code == 400 and "4" in caught.value.message


def test_serving_leaves_one_core_to_the_front_end_from_four_cores() -> None:
    from pagedserve.server.launcher import default_engine_threads_when_serving

    assert default_engine_threads_when_serving(1) == 1
    assert default_engine_threads_when_serving(2) == 2
    assert default_engine_threads_when_serving(3) == 3
    assert default_engine_threads_when_serving(4) == 3
    assert default_engine_threads_when_serving(16) == 15
