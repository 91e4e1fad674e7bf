"""Request ids as vLLM takes them (header over body field over a random id), their bounds, the engine ids the
endpoints run them under, and the response-header middleware."""
from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pagedserve.server.errors import OpenAIError
from pagedserve.server.request_ids import (MAX_REQUEST_ID_CHARS, RequestIdHeaderMiddleware, base_request_id,
                                           chat_request_id, completion_prompt_request_id, completion_request_id,
                                           engine_request_id)


def test_header_wins_over_the_body_field_and_a_random_id_fills_in() -> None:
    assert base_request_id("from-header", "from-body") == "from-header"
    assert base_request_id(None, "from-body") == "from-body"
    first, second = base_request_id(None, None), base_request_id(None, None)
    assert len(first) == 32 and first != second


@pytest.mark.parametrize("header, body, field", [
    ("", None, "X-Request-Id"), (None, "", "request_id"), (None, "x" * (MAX_REQUEST_ID_CHARS + 1), "request_id"),
    (None, "tab\there", "request_id"), (None, "é", "request_id")])
def test_bad_ids_are_a_400_naming_the_field(header, body, field) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(OpenAIError) as error:
        base_request_id(header, body)
    assert error.value.status_code == 400 and error.value.param == "request_id"
    assert error.value.message.startswith(f"{field}=")
    assert base_request_id(None, "x" * MAX_REQUEST_ID_CHARS) == "x" * MAX_REQUEST_ID_CHARS


def test_engine_ids_follow_the_endpoints() -> None:
    assert chat_request_id("a") == engine_request_id("/v1/chat/completions", "a") == "chatcmpl-a"
    assert completion_request_id("a") == "cmpl-a"
    assert completion_prompt_request_id("a", 0) == engine_request_id("/v1/completions", "a") == "cmpl-a-0"
    with pytest.raises(ValueError, match="endpoint='/v1/embeddings' must be"):
        engine_request_id("/v1/embeddings", "a")


def test_the_middleware_echoes_the_header_or_makes_one() -> None:
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {}

    app.add_middleware(RequestIdHeaderMiddleware)
    client = TestClient(app)
    assert client.get("/ping", headers={"X-Request-Id": "abc"}).headers["x-request-id"] == "abc"
    made = client.get("/ping").headers["x-request-id"]
    assert len(made) == 32 and made != client.get("/ping").headers["x-request-id"]
