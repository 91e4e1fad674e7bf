"""OpenAI-style error responses: every failure leaves the server as {"error": {...}} JSON.

Client mistakes map to 400/401/404/413/422/429 (never 500); a dead engine is 503.
"""
from __future__ import annotations

from http import HTTPStatus

from starlette.responses import JSONResponse

# HTTP status -> the error type name OpenAI's clients know.
_ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """Raise inside a handler to answer with this status and an OpenAI-style error body."""

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.headers = headers


def error_body(status_code: int, message: str, param: str | None = None) -> dict[str, object]:
    error_type = _ERROR_TYPES.get(status_code) or HTTPStatus(status_code).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": error_type, "param": param, "code": status_code}}


def error_response(status_code: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status_code, message, param), status_code=status_code, headers=headers)
