"""Request limits: the body-size cap (an ASGI middleware) and bounded admission (429 + Retry-After).

Admission counts engine requests (a request with n > 1 counts n). The engine runs at most
max_num_seqs at once; everything admitted beyond that waits. A new request that would make more
than max_waiting_requests wait is refused with 429 and a Retry-After header, so under overload
clients back off instead of piling up unbounded queues (and memory) in the server.
"""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.server.errors import OpenAIError, error_response
from pagedserve.server.serve_args import DEFAULT_MAX_BODY_BYTES

RETRY_AFTER_SECONDS = 1


def check_admission(num_engine_requests: int, num_new: int, max_num_seqs: int, max_waiting_requests: int) -> None:
    """Raise OpenAIError(429) when admitting `num_new` more engine requests exceeds the waiting bound,
    and 400 when the request alone could never fit (so retrying would not help)."""
    capacity = max_num_seqs + max_waiting_requests
    if num_new > capacity:
        raise OpenAIError(400, f"the request needs {num_new} sequences (prompts x n), more than this server ever "
                               f"admits at once: max_num_seqs + max_waiting_requests = {capacity}")
    num_waiting_after = num_engine_requests + num_new - max_num_seqs
    if num_waiting_after > max_waiting_requests:
        raise OpenAIError(
            429, f"the server is overloaded: {max(0, num_engine_requests - max_num_seqs)} requests are waiting and "
                 f"max_waiting_requests={max_waiting_requests}; retry after {RETRY_AFTER_SECONDS} s",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


class BodySizeLimitMiddleware:
    """ASGI middleware answering 413 when a request body is larger than `max_body_bytes`.

    A declared Content-Length over the cap is refused before reading; a chunked body is read up to
    the cap and refused as soon as it goes over. Accepted bodies are replayed to the app unchanged.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={max_body_bytes} must be >= 1")
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> OpenAIError:
        return OpenAIError(413, f"request body is larger than the limit of {self.max_body_bytes} bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await error_response(400, f"Content-Length={value!r} is not an integer")(scope, receive, send)
                    return
                if declared > self.max_body_bytes:
                    await error_response(413, str(self._too_large()))(scope, receive, send)
                    return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await error_response(413, str(self._too_large()))(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # After the body: the disconnect notice, when it comes.

        await self.app(scope, replay, send)
