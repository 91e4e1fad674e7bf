"""The FastAPI application: OpenAI endpoints plus /health, /version, /metrics, /tokenize, /detokenize.

`build_app(state, api_key=..., max_body_bytes=...)` wires handlers, error mapping and middlewares
around one ServerState; the launcher (launcher.py) owns the engine process and uvicorn.

Error mapping (all bodies OpenAI-style, see errors.py): ValueError from validation -> 400, malformed
JSON or a body that is not valid UTF-8 text (request_text.py) -> 400, a body that does not fit the
schema -> 422, unknown route -> 404, unknown model -> 404, missing/wrong key -> 401, too large -> 413,
overloaded -> 429, engine dead or shutting down -> 503.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

import pagedserve
from pagedserve.engine.async_llm import EngineDeadError
from pagedserve.server.auth import APIKeyMiddleware
from pagedserve.server.chat import ChatHandler
from pagedserve.server.completions import CompletionHandler
from pagedserve.server.errors import OpenAIError, error_response
from pagedserve.server.limits import BodySizeLimitMiddleware
from pagedserve.server.serve_args import DEFAULT_MAX_BODY_BYTES
from pagedserve.server.metrics import CONTENT_TYPE_LATEST
from pagedserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ModelCard,
                                        ModelList, TokenizeRequest)
from pagedserve.server.request_ids import RequestIdHeaderMiddleware
from pagedserve.server.request_text import TextCheckedRoute
from pagedserve.server.state import ServerState
from pagedserve.server.tool_calling import check_tools

logger = logging.getLogger(__name__)

# The longest repr of a rejected value that a 422 message quotes.
MAX_QUOTED_VALUE_CHARS = 60


def _quoted_value(value: object) -> str:
    text = repr(value)
    return text if len(text) <= MAX_QUOTED_VALUE_CHARS else text[:MAX_QUOTED_VALUE_CHARS - 3] + "..."


def _validation_message(error: RequestValidationError) -> tuple[int, str, str | None]:
    """(status, message, param) for a body FastAPI could not parse (400) or validate (422).

    Each of the first five problems reads `field=value: what was expected`; the value is left out for
    a missing field and for the body as a whole.
    """
    details = error.errors()
    if any(detail.get("type") == "json_invalid" for detail in details):
        return 400, "the request body is not valid JSON", None
    parts = []
    param = None
    for detail in details[:5]:
        location = ".".join(str(item) for item in detail.get("loc", ()) if item != "body")
        param = param or location or None
        value = f"={_quoted_value(detail['input'])}" if location and detail.get(
            "type") != "missing" and "input" in detail else ""
        parts.append(f"{location or 'body'}{value}: {detail.get('msg')}")
    return 422, "; ".join(parts), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def on_openai_error(request: Request, error: OpenAIError) -> Response:
        return error_response(error.status_code, error.message, error.param, error.headers)

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, error: ValueError) -> Response:
        return error_response(400, str(error))

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, error: EngineDeadError) -> Response:
        return error_response(503, str(error))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, error: RequestValidationError) -> Response:
        status, message, param = _validation_message(error)
        return error_response(status, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException) -> Response:
        return error_response(error.status_code, str(error.detail), headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, error: Exception) -> Response:
        logger.exception("unexpected error serving %s", request.url.path)
        return error_response(500, f"internal server error: {type(error).__name__}")


def build_app(state: ServerState, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, enable_request_id_headers: bool = False) -> FastAPI:
    app = FastAPI(title="pagedserve", version=pagedserve.__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    # Before any route is added: every route checks that its body is valid UTF-8 text before parsing it.
    app.router.route_class = TextCheckedRoute
    app.state.server = state
    engine = state.engine
    completions = CompletionHandler(state)
    chat = ChatHandler(state)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_dead:
            return error_response(503, f"the engine is dead: {engine.dead_error}")
        if state.is_shutting_down:
            return error_response(503, "the server is shutting down")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": pagedserve.__version__})

    @app.get("/kv_transfer_info")
    async def kv_transfer_info() -> JSONResponse:
        # For a PD proxy: this server's KV connector role and mode, and a producer's block-server address.
        return JSONResponse(engine.kv_transfer_info().to_json())

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [ModelCard(id=name, root=engine.config.model_config.model, max_model_len=engine.max_model_len)
                 for name in state.served_model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create(body, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create(body, raw_request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        state.resolve_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        if body.messages is not None:
            chat_body = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt)
            if body.tools:
                check_tools(body.tools)
            token_ids = chat.prompt_token_ids(chat_body, body.tools or None)
        else:
            assert body.prompt is not None
            token_ids = list(engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        result: dict[str, object] = {"count": len(token_ids), "max_model_len": engine.max_model_len,
                                     "tokens": token_ids}
        if body.return_token_strs:
            result["token_strs"] = engine.tokenizer.convert_ids_to_tokens(token_ids)
        return JSONResponse(result)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        state.resolve_model(body.model)
        vocab_size = engine.input_processor.vocab_size
        for token_id in body.tokens:
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"tokens contains {token_id}, outside [0, {vocab_size}) (vocab_size={vocab_size})")
        return JSONResponse({"prompt": engine.tokenizer.decode(body.tokens)})

    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes)
    if enable_request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    if api_key is not None:
        # Added last so it runs first: an unauthenticated client's body is never even read.
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app
