"""Request bodies must be UTF-8 whose strings are valid Unicode (RFC 8259, section 8.1); else a 400 naming the field.

Starlette parses a body with `json.loads(bytes)`, which decodes UTF-8 with 'surrogatepass': the encoded
surrogate ED A0 80, like the JSON escape "\\ud800" without its pair, becomes a str holding an unpaired
surrogate. No tokenizer, msgpack encoder or JSON response can take such a str, so it failed deep inside a
handler (a 500, or worse, after the engine request was registered). Other invalid bytes made `json.loads`
raise UnicodeDecodeError, answered with a 400 that named nothing.

`TextCheckedRoute` checks the raw body before FastAPI parses it. Well-formed bodies cost one strict UTF-8
decode and one regular-expression scan; only a body that fails either is parsed here, to name the field.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Coroutine

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from pagedserve.server.errors import OpenAIError

# A JSON escape of a UTF-16 surrogate (\ud800-\udfff). A high one followed by a low one is a valid pair
# (json.loads joins them into one character), so a body that matches is parsed to look for unpaired ones.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def is_valid_unicode(text: str) -> bool:
    """False when `text` holds an unpaired surrogate (it then has no UTF-8 encoding)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def find_invalid_text(value: Any, path: str = "") -> str | None:
    """Where the first string (or object key) that is not valid Unicode sits in a parsed JSON value.

    Returns a path such as "prompt", "messages[0].content" or "a key of logit_bias"; None when every
    string is valid. The path is built from valid keys only, so it can always be sent back.
    """
    if isinstance(value, str):
        return None if is_valid_unicode(value) else (path or "the request body")
    if isinstance(value, dict):
        for key, item in value.items():
            if not is_valid_unicode(key):
                return f"a key of {path or 'the request body'}"
            found = find_invalid_text(item, f"{path}.{key}" if path else key)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = find_invalid_text(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def _locate(text: str) -> str | None:
    """The field holding invalid text in the JSON `text`; None when it does not parse or none does."""
    try:
        document = json.loads(text)
    except ValueError:
        return None
    return find_invalid_text(document)


def check_body_text(body: bytes) -> None:
    """Raise OpenAIError(400) naming the field when `body` is not UTF-8 or one of its JSON strings holds an
    unpaired surrogate escape; return silently otherwise (including for bodies that are not JSON at all,
    which FastAPI answers itself)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        # surrogateescape turns each invalid byte into a lone surrogate, so the JSON still parses and the
        # walk finds the string that held it.
        field = _locate(body.decode("utf-8", errors="surrogateescape"))
        invalid = " ".join(f"{byte:02X}" for byte in error.object[error.start:error.end])
        raise OpenAIError(400, f"{field or 'the request body'} is not valid UTF-8: byte {invalid} at offset "
                               f"{error.start} of the request body ({error.reason}); send JSON encoded as UTF-8",
                          param=_param_of(field)) from None
    if _SURROGATE_ESCAPE.search(text) is None:
        return
    field = _locate(text)
    if field is not None:
        raise OpenAIError(400, f"{field} holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff without its "
                               "pair), which is not a Unicode character; send valid Unicode text",
                          param=_param_of(field))


def _param_of(field: str | None) -> str | None:
    """The error's `param` for a `find_invalid_text` path: the object holding a bad key, None for the body."""
    if field is None:
        return None
    field = field.removeprefix("a key of ")
    return None if field == "the request body" else field


class TextCheckedRoute(APIRoute):
    """An APIRoute that runs `check_body_text` on the request body before FastAPI parses and validates it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handle_checked(request: Request) -> Response:
            # Starlette keeps the body on the Request, so FastAPI's handler reads the same bytes again for free.
            check_body_text(await request.body())
            return await handle(request)

        return handle_checked
