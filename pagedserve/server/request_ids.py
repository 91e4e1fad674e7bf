"""Request ids of the OpenAI endpoints, as vLLM chooses them.

The caller may choose a request's id: the `X-Request-Id` header, else the body's `request_id` field (chat and
completions), else a random one. The engine runs the request under that base with the endpoint's prefix:
`chatcmpl-<base>` for a chat request, `cmpl-<base>-<i>` for prompt i of a completion request; the response's `id`
is `chatcmpl-<base>` / `cmpl-<base>`. A proxy that must name a request to an engine's KV connector (the push mode's
order names P's request) derives the engine id with `engine_request_id`.

A base already used by a request still running on the server is refused (400, param `request_id`): the engine
never runs two requests under one id.

With `--enable-request-id-headers` every response carries `X-Request-Id`: the caller's header, or a random hex
id (vLLM's middleware does the same).
"""
from __future__ import annotations

import uuid

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.server.errors import OpenAIError

REQUEST_ID_HEADER = "X-Request-Id"
CHAT_COMPLETIONS_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
# The longest caller-chosen id (ids travel in logs and KV connector messages: a bound keeps them small).
MAX_REQUEST_ID_CHARS = 256


def base_request_id(header_value: str | None, body_value: str | None) -> str:
    """The base id of a request: the X-Request-Id header, else the body's request_id, else a random hex id.

    Raises OpenAIError 400 (naming the field) for an id that is empty, too long or not printable ASCII.
    """
    for field_name, value in ((REQUEST_ID_HEADER, header_value), ("request_id", body_value)):
        if value is None:
            continue
        if not value or len(value) > MAX_REQUEST_ID_CHARS or not value.isascii() or not value.isprintable():
            raise OpenAIError(400, f"{field_name}={value[:80]!r} must be 1 to {MAX_REQUEST_ID_CHARS} printable "
                                   f"ASCII characters", param="request_id")
        return value
    return uuid.uuid4().hex


def duplicate_request_error(base: str) -> OpenAIError:
    """The 400 for a base id that a request still running on this server uses."""
    return OpenAIError(400, f"request_id={base!r} is already used by a request still running on this server; "
                            f"give each request its own id (the body's request_id or the {REQUEST_ID_HEADER} "
                            f"header)", param="request_id")


def chat_request_id(base: str) -> str:
    """The chat request's id (response `id` and engine request id)."""
    return f"chatcmpl-{base}"


def completion_request_id(base: str) -> str:
    """The completion response's `id`; prompt i runs in the engine as `completion_prompt_request_id(.., i)`."""
    return f"cmpl-{base}"


def completion_prompt_request_id(base: str, prompt_index: int) -> str:
    return f"{completion_request_id(base)}-{prompt_index}"


def engine_request_id(endpoint: str, base: str) -> str:
    """The engine request id a one-prompt request sent to `endpoint` with base id `base` runs under."""
    if endpoint == CHAT_COMPLETIONS_ENDPOINT:
        return chat_request_id(base)
    if endpoint == COMPLETIONS_ENDPOINT:
        return completion_prompt_request_id(base, 0)
    raise ValueError(f"endpoint={endpoint!r} must be {CHAT_COMPLETIONS_ENDPOINT!r} or {COMPLETIONS_ENDPOINT!r}")


class RequestIdHeaderMiddleware:
    """Adds X-Request-Id to every HTTP response: the request's own header, else a random hex id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_headers = {name.lower(): value for name, value in scope.get("headers", [])}
        request_id = request_headers.get(REQUEST_ID_HEADER.lower().encode(), b"").decode("latin-1") \
            or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append(REQUEST_ID_HEADER, request_id)
            await send(message)

        await self.app(scope, receive, send_with_id)
