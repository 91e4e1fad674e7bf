"""The prefill/decode proxy: an OpenAI-compatible front over P (KV producer) and D (KV consumer) servers.

Each POST /v1/completions or /v1/chat/completions gets one request id: the caller's (its X-Request-Id header, else
the body's request_id, checked as the servers check them: server/request_ids.py), else a random one. It is the
X-Request-Id header of the proxy's answer and of its call to D; P's call carries it suffixed "-prefill" (a kv_both instance may be P and D of one request, and
one engine runs one request per id). Then, per --kv-transfer-mode (kv_transfer_mode.py):
- pull: 1. to the least-loaded live P, not streamed, with max_tokens 1 and kv_transfer_params
  {"do_remote_decode": true} (P computes the prompt's KV and keeps its blocks); P's response carries the
  kv_transfer_params D needs; 2. to the least-loaded live D, with the client's own body plus those kv_transfer_params
  (D pulls the blocks instead of computing the prompt);
- push: to a D and a P at the same time: D with kv_transfer_params naming P's block server (learnt once from P's
  GET /kv_transfer_info; a P with several DP ranks: the rank the id names, kv_transfer/push_producer_rank.py) and
  the id P's engine runs the request under, P as in pull mode; D reserves blocks and
  orders the pages, P sends each layer's as its forward writes it. A failure of either call before D's answer is
  whole cancels the other (closing its connection aborts the request there, which frees its blocks).
D's answer, streamed (SSE) or whole, goes back to the client as it is. Without prefill instances the proxy only
balances: each request goes whole to one instance (colocated engines).

At start (and when an instance is first used or comes back) the proxy reads each instance's /kv_transfer_info and
refuses an instance whose role or mode does not fit, naming both modes: at start the proxy exits with that error.

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

from pagedserve.kv_transfer.kv_transfer_info import KVTransferInfo
from pagedserve.proxy.instance_pool import DECODE, PREFILL, Instance, InstancePool, NoInstanceError
from pagedserve.proxy.kv_transfer_mode import (KV_TRANSFER_MODES, instance_error, prefill_body, prefill_headers,
                                               prefill_request_id, push_kv_transfer_params)
from pagedserve.proxy.proxy_metrics import ProxyMetrics
from pagedserve.server.disconnect import run_until_disconnected
from pagedserve.server.errors import OpenAIError, error_body, error_response
from pagedserve.server.request_ids import REQUEST_ID_HEADER, base_request_id, engine_request_id
from pagedserve.server.streaming import SSE_DONE, SSE_HEADERS, sse_event

logger = logging.getLogger(__name__)

# Headers the client sent that instances get too (they share the client's API key, if any).
_FORWARDED_HEADERS = ("authorization",)


class UpstreamError(Exception):
    """A request an instance failed; carries the client's answer (status and OpenAI error message)."""

    def __init__(self, status_code: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param


class InstanceUnfitError(UpstreamError):
    """An instance whose KV role or mode does not fit the proxy (or that cannot say): a setup error, not an outage."""


def _upstream_error_message(content: bytes) -> tuple[str, str | None]:
    """The message and param of an instance's error body (OpenAI's shape), or its text when it has another shape."""
    try:
        error = json.loads(content)["error"]
        return str(error["message"]), error.get("param")
    except (ValueError, KeyError, TypeError):
        return content.decode(errors="replace")[:500] or "(empty body)", None


class PDProxy:
    """The proxy's state: the two pools, one HTTP client, the health probe, and the request flow."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], *, kv_transfer_mode: str = "pull",
                 timeout: float = 600.0, connect_timeout: float = 5.0, health_interval: float = 2.0) -> None:
        if kv_transfer_mode not in KV_TRANSFER_MODES:
            raise ValueError(f"kv_transfer_mode={kv_transfer_mode!r} must be one of {list(KV_TRANSFER_MODES)}")
        if not decode_urls:
            raise ValueError("decode_urls=[] is empty: give at least one --decode instance")
        for url in [*prefill_urls, *decode_urls]:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"instance url {url!r} must start with http:// or https://")
        if health_interval <= 0:
            raise ValueError(f"health_interval={health_interval} must be > 0")
        self.kv_transfer_mode = kv_transfer_mode
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
        """Open the HTTP client, probe every instance once, check the KV role and mode of every live one (ValueError
        naming both modes when one does not fit), then keep probing in the background."""
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._http = httpx.AsyncClient(timeout=self.timeout, limits=limits)
        await self.probe_all()
        if len(self.prefill):
            live = [instance for pool in self.pools for instance in pool.instances if instance.is_up]
            results = await asyncio.gather(*(self._transfer_info(instance) for instance in live),
                                           return_exceptions=True)
            for instance, result in zip(live, results):
                if isinstance(result, InstanceUnfitError):
                    await self._http.aclose()
                    raise ValueError(result.message)
                if isinstance(result, BaseException):  # busy or gone: checked when first used
                    logger.warning("%s: its KV role and mode are checked at first use (%s)", instance.name, result)
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
                instance.kv_transfer_info = None  # a restarted instance may serve its blocks on another port
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

    async def _transfer_info(self, instance: Instance) -> KVTransferInfo:
        """The instance's /kv_transfer_info (read once, again after it was down); UpstreamError when it cannot be
        read or the instance's role or mode does not fit this proxy."""
        if instance.kv_transfer_info is not None:
            return instance.kv_transfer_info
        try:
            response = await self.http.get(f"{instance.url}/kv_transfer_info", timeout=max(self.connect_timeout, 5.0))
        except httpx.HTTPError as error:
            raise self._connection_error(instance, error) from None
        if response.status_code == 404:
            raise InstanceUnfitError(502, f"{instance.name} has no GET /kv_transfer_info (it answered 404): the proxy "
                                          f"needs `pagedserve serve` instances of this version")
        if response.status_code != 200:
            raise self._status_error(instance, response.status_code, response.content)
        try:
            info = KVTransferInfo.from_json(response.json())
        except ValueError as error:
            raise InstanceUnfitError(502, f"{instance.name}: GET /kv_transfer_info: {error}") from None
        problem = instance_error(instance.name, instance.role, info, self.kv_transfer_mode)
        if problem is not None:
            raise InstanceUnfitError(502, problem)
        instance.kv_transfer_info = info
        return info

    async def _open_stream(self, instance: Instance, endpoint: str, body: dict[str, Any],
                           headers: dict[str, str]) -> httpx.Response:
        """A streamed call whose status is 200 (the status is known before the first byte goes back, so an error
        answer keeps its status); UpstreamError naming the instance otherwise."""
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
        return response

    async def _prefill(self, endpoint: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        """Pull mode: send the prompt to a P; returns the kv_transfer_params its response carries."""
        instance = await self._pick_checked(self.prefill)
        try:
            response = await self._post(instance, endpoint, prefill_body(body), prefill_headers(headers))
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

    async def _pick_checked(self, pool: InstancePool) -> Instance:
        """The least-loaded live instance of `pool`, its KV role and mode checked (counted in flight)."""
        instance = self._pick(pool)
        try:
            await self._transfer_info(instance)
        except BaseException:
            instance.num_in_flight -= 1
            raise
        return instance

    async def generate(self, endpoint: str, body: dict[str, Any], headers: dict[str, str],
                       caller_request_id: str | None = None) -> Response:
        """The whole flow of one completion or chat request (see the module docstring); `caller_request_id` is the
        caller's X-Request-Id header."""
        body_request_id = body.get("request_id")
        if body_request_id is not None and not isinstance(body_request_id, str):
            raise OpenAIError(400, f"request_id={body_request_id!r} must be a string", param="request_id")
        request_id = base_request_id(caller_request_id, body_request_id)
        headers = {**headers, REQUEST_ID_HEADER: request_id}
        if len(self.prefill) and self.kv_transfer_mode == "push":
            response = await self._generate_push(endpoint, body, headers, request_id)
        else:
            response = await self._generate_pull(endpoint, body, headers)
        response.headers[REQUEST_ID_HEADER] = request_id
        return response

    async def _generate_pull(self, endpoint: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        if len(self.prefill):
            body = dict(body, kv_transfer_params=await self._prefill(endpoint, body, headers))
            instance = await self._pick_checked(self.decode)
        else:
            instance = self._pick(self.decode)
        if not body.get("stream"):
            try:
                response = await self._post(instance, endpoint, body, headers)
                return Response(response.content, status_code=200, media_type="application/json")
            finally:
                instance.num_in_flight -= 1
        try:
            response = await self._open_stream(instance, endpoint, body, headers)
        except BaseException:
            instance.num_in_flight -= 1
            raise
        return RelayResponse(self._relay(instance, response), _UpstreamStream(instance, response))

    async def _generate_push(self, endpoint: str, body: dict[str, Any], headers: dict[str, str],
                             request_id: str) -> Response:
        """Push mode: D and P at once (see the module docstring). Every path ends both calls and their in-flight
        counts; only a relayed stream keeps D's, until RelayResponse releases it."""
        prefill = await self._pick_checked(self.prefill)
        try:
            decode = await self._pick_checked(self.decode)
        except BaseException:
            prefill.num_in_flight -= 1
            raise
        assert prefill.kv_transfer_info is not None
        is_stream = bool(body.get("stream"))
        decode_body = dict(body, kv_transfer_params=push_kv_transfer_params(
            prefill.kv_transfer_info, engine_request_id(endpoint, prefill_request_id(request_id))))
        decode_call = self._open_stream if is_stream else self._post
        decode_task = asyncio.ensure_future(decode_call(decode, endpoint, decode_body, headers))
        prefill_task = asyncio.ensure_future(self._post(prefill, endpoint, prefill_body(body),
                                                        prefill_headers(headers)))
        is_relayed = False
        try:
            await asyncio.wait({decode_task, prefill_task}, return_when=asyncio.FIRST_EXCEPTION)
            # P's failure first: D's may only follow from it (D's load failed, or it was cancelled).
            for task in (prefill_task, decode_task):
                if task.done() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            if not is_stream and decode_task.done():
                # D's answer is whole (the KV arrived): P's call ends on its own; its outcome changes nothing.
                await asyncio.gather(prefill_task, return_exceptions=True)
            else:
                await prefill_task
            response = await decode_task
            if not is_stream:
                return Response(response.content, status_code=200, media_type="application/json")
            is_relayed = True
            return RelayResponse(self._relay(decode, response), _UpstreamStream(decode, response))
        except BaseException:
            # Closing a call's connection makes that server abort its request (and free its blocks): D's reserved
            # blocks when P failed, P's computed ones when D refused the request.
            for task in (decode_task, prefill_task):
                task.cancel()
            results = await asyncio.gather(decode_task, prefill_task, return_exceptions=True)
            if isinstance(results[0], httpx.Response):  # D's stream was open
                await results[0].aclose()
            raise
        finally:
            prefill.num_in_flight -= 1
            if not is_relayed:
                decode.num_in_flight -= 1

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
        # Until the answer starts, a client that leaves cancels the work (its upstream calls end, which aborts their
        # requests); a relayed stream is then released by RelayResponse when the client leaves.
        return await run_until_disconnected(request, proxy.generate(endpoint, body, forwarded_headers(request),
                                                                    request.headers.get(REQUEST_ID_HEADER)))

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
    proxy = PDProxy(args.prefill, args.decode, kv_transfer_mode=args.kv_transfer_mode, timeout=args.timeout, connect_timeout=args.connect_timeout,
                    health_interval=args.health_interval)
    app = build_proxy_app(proxy)

    async def main() -> None:
        await proxy.start()
        try:
            config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                    access_log=False, lifespan="off", timeout_keep_alive=5)
            mode = (f"{len(proxy.prefill)} prefill, {len(proxy.decode)} decode instances, "
                    f"{proxy.kv_transfer_mode} mode" if len(proxy.prefill)
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
