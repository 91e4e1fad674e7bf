"""API-key authentication: `Authorization: Bearer <key>` on every path but /health, /version and
/kv_transfer_info (a PD proxy reads it at start, before any client; it names a KV role, mode and address).

The key comes from --api-key or PAGEDSERVE_API_KEY. It is compared with hmac.compare_digest on the
SHA-256 digests of both sides, so the comparison takes the same time whatever the key's length or
the position of the first wrong character.
"""
from __future__ import annotations

import hashlib
import hmac
import os

from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve.server.errors import error_response
from pagedserve.server.serve_args import API_KEY_ENV

# Paths a load balancer or a monitor must reach without the key.
PUBLIC_PATHS = frozenset({"/health", "/version", "/kv_transfer_info"})


def resolve_api_key(api_key: str | None) -> str | None:
    """The key from the flag, else from PAGEDSERVE_API_KEY; None (no auth) when neither is set."""
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key:
        raise ValueError(f"api_key is empty; give a non-empty key or unset --api-key/{API_KEY_ENV}")
    return key


def is_key_valid(presented: str, expected_digest: bytes) -> bool:
    digest = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
    return hmac.compare_digest(digest, expected_digest)


class APIKeyMiddleware:
    """ASGI middleware answering 401 (OpenAI-style JSON) without a valid bearer key."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected_digest = hashlib.sha256(api_key.encode("utf-8")).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        authorization = ""
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not is_key_valid(token.strip(), self.expected_digest):
            response = error_response(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                      headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
