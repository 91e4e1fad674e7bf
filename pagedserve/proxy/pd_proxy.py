"""The prefill/decode proxy: an OpenAI-compatible front over P (KV producer) and D (KV consumer) servers.

Each POST /v1/completions or /v1/chat/completions goes
  1. to the least-loaded live P, not streamed, with max_tokens 1 and kv_transfer_params {"do_remote_decode": true}
     (P computes the prompt's KV and keeps its blocks); P's response carries the kv_transfer_params D needs;
  2. to the least-loaded live D, with the client's own body plus those kv_transfer_params (D pulls the blocks
     instead of computing the prompt); D's answer, streamed (SSE) or whole, goes back to the client as it is.
Without prefill instances the proxy only balances: each request goes whole to one instance (colocated engines).

Failures stay per request: an instance that refuses the connection is marked down (503 for that request; new ones
go to the others) until its /health answers 200 again; one that dies mid-answer fails that request (502, or an
SSE error event once the stream has begun). An instance's own error answer keeps its status and OpenAI error body,
its message prefixed with the instance. The proxy itself keeps serving through all of these.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse

from pagedserve.proxy.instance_pool import DECODE, PREFILL, Instance, InstancePool, NoInstanceError
from pagedserve.proxy.proxy_metrics import ProxyMetrics
from pagedserve.server.disconnect import run_until_disconnected
from pagedserve.server.errors import OpenAIError, error_body, error_response
from pagedserve.server.streaming import SSE_DONE, SSE_HEADERS, sse_event

logger = logging.getLogger(__name__)

# Fields of the client's body that P does not get: P samples one token that nobody reads (D samples the first
# token itself from the pulled KV), so only what shapes the prompt matters there. A stop string could even end
# P's request in the front end, before its kv_transfer_params are made (docs/kv_transfer.md).
_FIELDS_NOT_FOR_PREFILL = ("stream", "stream_options", "max_completion_tokens", "min_tokens", "stop",
                           "stop_token_ids", "n", "best_of", "logprobs", "top_logprobs", "echo", "response_format",
                           "structured_outputs", "return_token_ids", "include_stop_str_in_output")
# Headers the client sent that instances get too (they share the client's API key, if any).
_FORWARDED_HEADERS = ("authorization",)


class UpstreamError(Exception):
    """A request an instance failed; carries the client's answer (status and OpenAI error message)."""

    def __init__(self, status_code: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param


def _upstream_error_message(content: bytes) -> tuple[str, str | None]:
    """The message and param of an instance's error body (OpenAI's shape), or its text when it has another shape."""
    try:
        error = json.loads(content)["error"]
        return str(error["message"]), error.get("param")
    except (ValueError, KeyError, TypeError):
        return content.decode(errors="replace")[:500] or "(empty body)", None


class PDProxy:
    """The proxy's state: the two pools, one HTTP client, the health probe, and the request flow."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], *, timeout: float = 600.0,
                 connect_timeout: float = 5.0, health_interval: float = 2.0) -> None:
        if not decode_urls:
            raise ValueError("decode_urls=[] is empty: give at least one --decode instance")
        for url in [*prefill_urls, *decode_urls]:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"instance url {url!r} must start with http:// or https://")
        if health_interval <= 0:
            raise ValueError(f"health_interval={health_interval} must be > 0")
        self.prefill = InstancePool(PREFILL, prefill_urls)
        self.decode = InstancePool(DECODE, decode_urls)
        self.metrics = ProxyMetrics([self.prefill, self.decode])
        self.timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self.connect_timeout = connect_timeout
        self.health_interval = health_interval
        self._http: httpx.AsyncClient | None = None
        self._probe_task: asyncio.Task[None] | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        assert self._http is not None, "PDProxy.start() was not called"
        return self._http

    @property
    def pools(self) -> list[InstancePool]:
        return [pool for pool in (self.prefill, self.decode) if len(pool)]

    # ----------------------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Open the HTTP client, probe every instance once, then keep probing in the background."""
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._http = httpx.AsyncClient(timeout=self.timeout, limits=limits)
        await self.probe_all()
        self._probe_task = asyncio.create_task(self._probe_forever())

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(instance) for pool in self.pools for instance in pool.instances))

    async def _probe(self, instance: Instance) -> None:
        try:
            response = await self.http.get(f"{instance.url}/health", timeout=max(self.connect_timeout, 5.0))
        except httpx.TimeoutException:
            return  # A busy instance answers late: keep what we knew (a refused connection is what says dead).
        except httpx.HTTPError as error:
            self._mark_down(instance, f"/health: {type(error).__name__}: {error}")
            return
        if response.status_code == 200:
            if not instance.is_up:
                logger.warning("%s is up again", instance.name)
            instance.is_up, instance.last_error = True, ""
        else:
            message, _ = _upstream_error_message(response.content)
            self._mark_down(instance, f"/health answered {response.status_code}: {message}")

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await self.probe_all()
            except Exception:  # noqa: BLE001 - the probe must outlive any one bad answer
                logger.exception("health probe failed")

    def _mark_down(self, instance: Instance, reason: str) -> None:
        if instance.is_up:
            logger.warning("%s is down: %s", instance.name, reason)
        instance.is_up, instance.last_error = False, reason

    # ----------------------------------------------------------------------------------------- requests
    def _connection_error(self, instance: Instance, error: httpx.HTTPError) -> UpstreamError:
        """The client's answer for a transport failure at `instance`, which is counted (and marked down when dead)."""
        instance.num_failures += 1
        detail = f"{type(error).__name__}: {error}".rstrip(": ")
        if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout)):
            self._mark_down(instance, detail)
            return UpstreamError(503, f"{instance.name} is unreachable ({detail}); it gets no new requests until its "
                                      f"/health answers 200")
        if isinstance(error, httpx.TimeoutException):
            return UpstreamError(504, f"{instance.name} did not answer in time ({detail})")
        # The connection broke mid-answer: the instance most likely died (the probe brings it back if not).
        self._mark_down(instance, detail)
        return UpstreamError(502, f"{instance.name} failed while answering ({detail})")

    def _status_error(self, instance: Instance, status_code: int, content: bytes) -> UpstreamError:
        if status_code >= 500:
            instance.num_failures += 1
        message, param = _upstream_error_message(content)
        return UpstreamError(status_code, f"{instance.name}: {message}", param)

    @staticmethod
    def _pick(pool: InstancePool) -> Instance:
        try:
            instance = pool.pick()
        except NoInstanceError as error:
            raise UpstreamError(503, str(error)) from None
        instance.num_in_flight += 1
        instance.num_requests += 1
        return instance

    async def _post(self, instance: Instance, endpoint: str, body: dict[str, Any],
                    headers: dict[str, str]) -> httpx.Response:
        """One unstreamed call; UpstreamError (naming the instance) when it fails to connect or answers non-200."""
        try:
            response = await self.http.post(f"{instance.url}{endpoint}", json=body, headers=headers)
        except httpx.HTTPError as error:
            raise self._connection_error(instance, error) from None
        if response.status_code != 200:
            raise self._status_error(instance, response.status_code, response.content)
        return response

    async def _prefill(self, endpoint: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        """Send the prompt to a P; returns the kv_transfer_params its response carries."""
        prefill_body = {key: value for key, value in body.items() if key not in _FIELDS_NOT_FOR_PREFILL}
        prefill_body.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        instance = self._pick(self.prefill)
        try:
            response = await self._post(instance, endpoint, prefill_body, headers)
            try:
                kv_transfer_params = response.json().get("kv_transfer_params")
            except ValueError:
                kv_transfer_params = None
            if not isinstance(kv_transfer_params, dict):
                instance.num_failures += 1
                raise UpstreamError(502, f"{instance.name} returned no kv_transfer_params: start it with "
                                         "--kv-transfer-config '{\"kv_connector\": \"PullConnector\", "
                                         "\"kv_role\": \"kv_producer\"}'")
            return kv_transfer_params
        finally:
            instance.num_in_flight -= 1

    async def generate(self, endpoint: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        """The whole flow of one completion or chat request (see the module docstring)."""
        if len(self.prefill):
            body = dict(body, kv_transfer_params=await self._prefill(endpoint, body, headers))
        instance = self._pick(self.decode)
        if not body.get("stream"):
            try:
                response = await self._post(instance, endpoint, body, headers)
                return Response(response.content, status_code=200, media_type="application/json")
            finally:
                instance.num_in_flight -= 1
        # Streaming: the status is known before the first byte goes back, so an error answer keeps its status.
        try:
            request = self.http.build_request("POST", f"{instance.url}{endpoint}", json=body, headers=headers)
            try:
                response = await self.http.send(request, stream=True)
            except httpx.HTTPError as error:
                raise self._connection_error(instance, error) from None
            if response.status_code != 200:
                try:
                    content = await response.aread()
                except httpx.HTTPError:
                    content = b""
                await response.aclose()
                raise self._status_error(instance, response.status_code, content)
        except BaseException:
            instance.num_in_flight -= 1
            raise
        return RelayResponse(self._relay(instance, response), _UpstreamStream(instance, response))

    async def _relay(self, instance: Instance, response: httpx.Response) -> AsyncIterator[str]:
        """D's SSE events, one whole event at a time; a broken stream ends with an error event and [DONE]. The
        instance's in-flight count and the upstream response are released by RelayResponse."""
        event: list[str] = []
        try:
            async for line in response.aiter_lines():
                event.append(line)
                if not line:
                    yield "\n".join(event) + "\n"
                    event = []
        except httpx.HTTPError as error:
            failure = self._connection_error(instance, error)
            yield sse_event(json.dumps(error_body(failure.status_code, failure.message)))
            yield SSE_DONE

    async def models(self, headers: dict[str, str]) -> Response:
        instance = self._pick(self.decode)
        try:
            try:
                response = await self.http.get(f"{instance.url}/v1/models", headers=headers)
            except httpx.HTTPError as error:
                raise self._connection_error(instance, error) from None
            if response.status_code != 200:
                raise self._status_error(instance, response.status_code, response.content)
            return Response(response.content, status_code=200, media_type="application/json")
        finally:
            instance.num_in_flight -= 1

    def health(self) -> Response:
        """200 while every role has a live instance; else 503 naming what is down."""
        for pool in self.pools:
            if not pool.has_live_instance():
                reasons = "; ".join(f"{instance.url}: {instance.last_error}" for instance in pool.instances)
                return error_response(503, f"no {pool.role} instance is up ({reasons})")
        return Response(status_code=200)


class _UpstreamStream:
    """A streamed upstream answer and the in-flight count it holds on its instance; `release()` gives both back,
    once, whichever path gets there first."""

    def __init__(self, instance: Instance, response: httpx.Response) -> None:
        self.instance = instance
        self.response: httpx.Response | None = response

    async def release(self) -> None:
        if self.response is None:
            return
        response, self.response = self.response, None
        self.instance.num_in_flight -= 1
        await response.aclose()


class RelayResponse(StreamingResponse):
    """The SSE relay of one upstream stream. Releases the upstream stream however the response ends, including a
    client that disconnects before the first byte: Starlette then never starts the body iterator, so a `finally`
    inside it would never run (the instance would keep one request in flight and its connection open)."""

    def __init__(self, events: AsyncIterator[str], upstream: _UpstreamStream) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self.upstream = upstream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.upstream.release()


def build_proxy_app(proxy: PDProxy) -> FastAPI:
    """The proxy's FastAPI app; the caller runs proxy.start() / close() around serving it."""
    app = FastAPI(title="pagedserve proxy", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(UpstreamError)
    async def on_upstream_error(request: Request, error: UpstreamError) -> Response:
        return error_response(error.status_code, error.message, error.param)

    @app.exception_handler(OpenAIError)
    async def on_openai_error(request: Request, error: OpenAIError) -> Response:
        return error_response(error.status_code, error.message, error.param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException) -> Response:
        return error_response(error.status_code, str(error.detail))

    def forwarded_headers(request: Request) -> dict[str, str]:
        return {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}

    async def json_body(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            raise OpenAIError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "the request body must be a JSON object")
        return body

    async def generate(endpoint: str, request: Request) -> Response:
        body = await json_body(request)
        work = proxy.generate(endpoint, body, forwarded_headers(request))
        if body.get("stream"):
            return await work  # A streamed answer is cancelled by Starlette when the client leaves.
        return await run_until_disconnected(request, work)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.models(forwarded_headers(request))

    @app.get("/health")
    async def health() -> Response:
        return proxy.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(proxy.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def run_proxy(args: Any) -> int:
    """The `pagedserve proxy` handler: serve until SIGINT / SIGTERM."""
    import sys

    import uvicorn

    if not 1 <= args.port <= 65535:
        raise ValueError(f"port={args.port} must be in [1, 65535]")
    proxy = PDProxy(args.prefill, args.decode, timeout=args.timeout, connect_timeout=args.connect_timeout,
                    health_interval=args.health_interval)
    app = build_proxy_app(proxy)

    async def main() -> None:
        await proxy.start()
        try:
            config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                    access_log=False, lifespan="off", timeout_keep_alive=5)
            mode = (f"{len(proxy.prefill)} prefill, {len(proxy.decode)} decode instances" if len(proxy.prefill)
                    else f"{len(proxy.decode)} colocated instances")
            print(f"pagedserve proxy: {mode} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
            await uvicorn.Server(config).serve()
        finally:
            await proxy.close()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        return 130
    return 0
