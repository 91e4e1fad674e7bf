"""AsyncLLM: the asyncio front end of an engine running in its own process (the server's engine).

The server process owns the tokenizer, the InputProcessor (tokenize, validate, fan out n > 1) and the
OutputProcessor (incremental detokenization, stop strings, logprobs); the engine process owns only
EngineCore's busy loop. One background task reads the engine's outputs and routes each RequestOutput
to its request's queue; another watches the engine process and, if it dies, fails every request at
once with EngineDeadError and tells the owner (the server turns /health to 503 and exits).

Usage:
    engine = await AsyncLLM.start(dict(model=path, num_kv_blocks=64))
    stream = await engine.add_request("id-1", "Hello", SamplingParams(max_tokens=8))  # validates here
    async for output in stream:   # delta RequestOutputs; closing the stream early aborts the request
        ...
    await engine.shutdown()
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from pagedserve.config.engine import EngineConfig
from pagedserve.core.engine_core_output import SchedulerStats
from pagedserve.core.request import RequestStatus
from pagedserve.engine.core_client import EngineCoreClient, EngineUnreachableError, utility_result_value
from pagedserve.engine.input_processor import InputProcessor, PromptType, apply_chat_template, prompt_text_of
from pagedserve.engine.messages import EngineCoreOutputs, EngineFailure, UtilityResult
from pagedserve.engine.output_processor import OutputProcessor, RequestOutputKind
from pagedserve.kv_transfer.kv_transfer_info import KVTransferInfo
from pagedserve.model_loader.model_source import open_model_source
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output.grammar_validation import structured_outputs_refusal

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine process died: in-flight requests fail with this, new ones are refused."""


class StatLogger(Protocol):
    """Receives what metrics need; the server's Prometheus metrics implement it."""

    def record_scheduler_stats(self, stats: SchedulerStats) -> None: ...

    def record_first_token(self, time_to_first_token: float) -> None: ...

    def record_inter_token(self, inter_token_latency: float) -> None: ...

    def record_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None: ...

    def record_finished(self, finish_reason: str, e2e_latency: float) -> None: ...


class RequestStream:
    """The outputs of one user request, as an async iterator of delta RequestOutputs.

    Iterating past the end stops; an engine death raises EngineDeadError. `close()` (also called when
    an `async for` over `stream()` is left early, e.g. a client disconnect) aborts an unfinished
    request and frees its KV blocks in the engine.
    """

    def __init__(self, engine: "AsyncLLM", request_id: str, num_prompt_tokens: int, num_engine_requests: int,
                 arrival_time: float) -> None:
        self.engine = engine
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_engine_requests = num_engine_requests
        self.arrival_time = arrival_time
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.is_finished = False
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_generation_tokens = 0

    def put(self, item: RequestOutput | BaseException) -> None:
        self.queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.is_finished and self.queue.empty():
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.is_finished = True
            raise item
        if item.finished:
            self.is_finished = True
        return item

    async def stream(self) -> AsyncIterator[RequestOutput]:
        """Iterate the outputs; leaving the loop early (or a cancellation) aborts the request."""
        try:
            async for output in self:
                yield output
        finally:
            self.close()

    def close(self) -> None:
        """Abort the request if it is unfinished. Synchronous (the abort message is sent by a task),
        so it also works in a `finally` of a cancelled task, where awaiting could be cancelled again."""
        if not self.is_finished:
            self.is_finished = True
            self.engine.abort(self.request_id)


class DuplicateRequestError(ValueError):
    """add_request was given the id of a request still in flight (the engine runs one request per id)."""


class AsyncLLM:
    """Asynchronous engine client for the server; build with `await AsyncLLM.start(engine_kwargs)`."""

    def __init__(self, engine_kwargs: dict[str, Any], stat_logger: StatLogger | None = None) -> None:
        self.engine_kwargs = dict(engine_kwargs)
        self.config = EngineConfig.create(**self.engine_kwargs)
        model_config = self.config.model_config
        source = open_model_source(model_config.model)
        self.tokenizer = source.load_tokenizer(model_config.tokenizer)
        self.input_processor = InputProcessor(
            tokenizer=self.tokenizer, vocab_size=model_config.vocab_size, max_model_len=model_config.max_model_len,
            eos_token_ids=source.eos_token_ids(self.tokenizer),
            structured_outputs_refusal=structured_outputs_refusal(self.config))
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_logger = stat_logger
        self.client: EngineCoreClient | None = None
        self.streams: dict[str, RequestStream] = {}
        self.num_engine_requests = 0  # engine requests (n > 1 counts n) added and not yet finished
        self.latest_stats = SchedulerStats()
        self.dead_error: EngineDeadError | None = None
        self.is_shutting_down = False
        self.on_engine_dead: list[Callable[[EngineDeadError], None]] = []
        self._utility_futures: dict[int, asyncio.Future[Any]] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._background_sends: set[asyncio.Task[Any]] = set()

    @classmethod
    async def start(cls, engine_kwargs: dict[str, Any], stat_logger: StatLogger | None = None,
                    log_level: str = "WARNING", startup_timeout: float = 600.0) -> "AsyncLLM":
        """Start the engine process, validate the configuration and load the tokenizer here meanwhile, then wait
        until the engine is ready.

        The two processes start side by side: each spends seconds importing torch and transformers and
        building its EngineConfig, so overlapping them cuts the time to ready. A configuration this process
        rejects stops the engine process before the error is raised.
        """
        client_task = asyncio.create_task(EngineCoreClient.start(dict(engine_kwargs), log_level=log_level,
                                                                 startup_timeout=startup_timeout))
        try:
            # In a thread, so that the event loop keeps spawning and watching the engine process meanwhile.
            engine = await asyncio.to_thread(cls, engine_kwargs, stat_logger)
        except BaseException:
            client_task.cancel()  # EngineCoreClient.start shuts the process down when cancelled
            await asyncio.gather(client_task, return_exceptions=True)
            raise
        engine.client = await client_task
        engine._tasks = [asyncio.create_task(engine._output_loop(), name="pagedserve-output-loop"),
                         asyncio.create_task(engine._watch_engine(), name="pagedserve-engine-watch")]
        return engine

    # ------------------------------------------------------------------------------ properties
    @property
    def max_model_len(self) -> int:
        return self.config.model_config.max_model_len

    def kv_transfer_info(self) -> KVTransferInfo:
        """The prefill/decode KV connector's role, mode and block-server address (GET /kv_transfer_info)."""
        ready = self.client.ready if self.client is not None else None
        return KVTransferInfo.from_engine(self.config.kv_transfer_config,
                                          ready.kv_transfer_engine_id if ready is not None else "",
                                          list(ready.kv_transfer_ports) if ready is not None else [],
                                          list(ready.kv_transfer_data_parallel_ranks) if ready is not None else [])

    @property
    def max_num_seqs(self) -> int:
        return self.config.scheduler_config.max_num_seqs

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def engine_pid(self) -> int | None:
        return None if self.client is None else self.client.pid

    def num_waiting_requests(self) -> int:
        """Engine requests admitted beyond what the engine can run at once (max_num_seqs)."""
        return max(0, self.num_engine_requests - self.max_num_seqs)

    # ------------------------------------------------------------------------------ requests
    def tokenize(self, prompt: PromptType) -> list[int]:
        return self.input_processor.tokenize(prompt)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> list[int]:
        result = apply_chat_template(self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                     chat_template=chat_template, **kwargs)
        assert isinstance(result, list)
        return result

    def check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self.is_shutting_down or self.client is None:
            raise EngineDeadError("the engine is shutting down")

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          priority: int = 0, arrival_time: float | None = None) -> RequestStream:
        """Validate, tokenize and send one request; returns its stream of delta RequestOutputs.

        Raises ValueError (bad input, naming the field and the limit) before anything is sent, and
        EngineDeadError when the engine is gone.
        """
        self.check_alive()
        if request_id in self.streams:
            raise DuplicateRequestError(f"request_id={request_id!r} is already in flight")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        requests = self.input_processor.process(request_id, prompt, params, priority=priority, arrival_time=arrival)
        self.output_processor.add_request(request_id, prompt_text_of(prompt), requests, params,
                                          output_kind=RequestOutputKind.DELTA)
        stream = RequestStream(self, request_id, len(requests[0].prompt_token_ids), len(requests), arrival)
        self.streams[request_id] = stream
        self.num_engine_requests += len(requests)
        assert self.client is not None
        try:
            await self.client.add_requests(requests)
        except EngineUnreachableError as error:
            self.abort(request_id)
            raise EngineDeadError(str(error)) from None
        except BaseException:
            # Whatever failed the send (a value the message encoder rejects, a cancelled caller), the request was
            # registered above: undo it, or its admission slots stay counted and later requests see a full server.
            self.abort(request_id)
            raise
        return stream

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """vLLM-style: an async generator of delta RequestOutputs (aborts when closed early)."""
        stream = await self.add_request(request_id, prompt, params, priority=priority)
        async for output in stream.stream():
            yield output

    def abort(self, request_id: str) -> None:
        """Forget an unfinished request here and finish it in the engine (its KV blocks are freed).

        Synchronous: the bookkeeping happens now, the abort message goes out from a task.
        """
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return
        self.num_engine_requests -= stream.num_engine_requests
        engine_ids = self.output_processor.abort_requests([request_id])
        if self.stat_logger is not None:
            self.stat_logger.record_finished("abort", time.monotonic() - stream.arrival_time)
        if engine_ids and self.client is not None and not self.is_dead:
            self._send_in_background(self.client.abort_requests(engine_ids))

    def _send_in_background(self, coroutine: Any) -> None:
        async def send() -> None:
            try:
                await coroutine
            except EngineUnreachableError:
                pass  # The engine is gone; the watcher fails everything.

        task = asyncio.get_running_loop().create_task(send())
        # Keep a reference until it is done (the loop holds tasks only weakly).
        self._background_sends.add(task)
        task.add_done_callback(self._background_sends.discard)

    async def call_utility(self, method: str, timeout: float = 10.0) -> Any:
        """Ask the engine process something outside the step loop ('ping', 'stats')."""
        self.check_alive()
        assert self.client is not None
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        call_id = self.client.next_call_id()
        self._utility_futures[call_id] = future  # Registered first: the answer may come back at once.
        try:
            try:
                await self.client.send_utility_call(method, call_id)
            except EngineUnreachableError as error:
                raise EngineDeadError(str(error)) from None
            return await asyncio.wait_for(future, timeout)
        finally:
            self._utility_futures.pop(call_id, None)

    # ------------------------------------------------------------------------------ background
    async def _output_loop(self) -> None:
        assert self.client is not None
        try:
            while True:
                self._handle_output(await self.client.receive_output())
        except asyncio.CancelledError:
            raise
        except Exception as error:  # A bug here must fail requests loudly, not leave them hanging.
            logger.exception("the engine output loop failed")
            self._fail_everything(EngineDeadError(f"the engine output loop failed: {error!r}"))

    def _handle_output(self, message: Any) -> None:
        if isinstance(message, EngineCoreOutputs):
            self._process_engine_outputs(message)
        elif isinstance(message, UtilityResult):
            future = self._utility_futures.get(message.call_id)
            if future is not None and not future.done():
                try:
                    future.set_result(utility_result_value(message))
                except RuntimeError as error:
                    future.set_exception(error)
        elif isinstance(message, EngineFailure):
            logger.error("the engine process reported a failure: %s", message.message)
            self._fail_everything(EngineDeadError(f"the engine process failed: {message.message}"))

    def _process_engine_outputs(self, message: EngineCoreOutputs) -> None:
        self.latest_stats = message.stats
        stat_logger = self.stat_logger
        if stat_logger is not None:
            stat_logger.record_scheduler_stats(message.stats)
        if not message.outputs:
            return
        processed = self.output_processor.process_outputs(message.outputs)
        now = time.monotonic()
        for output in processed.request_outputs:
            stream = self.streams.get(output.request_id)
            if stream is None:
                continue
            num_new_tokens = sum(len(completion.token_ids) for completion in output.outputs)
            if num_new_tokens:
                if stream.first_token_time is None:
                    stream.first_token_time = now
                    if stat_logger is not None:
                        stat_logger.record_first_token(now - stream.arrival_time)
                        stat_logger.record_tokens(stream.num_prompt_tokens, 0)
                elif stat_logger is not None and stream.last_token_time is not None:
                    stat_logger.record_inter_token(now - stream.last_token_time)
                stream.last_token_time = now
                stream.num_generation_tokens += num_new_tokens
                if stat_logger is not None:
                    stat_logger.record_tokens(0, num_new_tokens)
            if output.finished:
                del self.streams[output.request_id]
                self.num_engine_requests -= stream.num_engine_requests
                if stat_logger is not None:
                    reasons = [c.finish_reason for c in output.outputs if c.finish_reason] or ["stop"]
                    stat_logger.record_finished(reasons[-1], now - stream.arrival_time)
            stream.put(output)
        if processed.request_ids_to_abort and self.client is not None:
            # Stop strings are found here, after detokenization: finish those requests in the core.
            self._send_in_background(
                self.client.abort_requests(processed.request_ids_to_abort, RequestStatus.FINISHED_STOPPED))

    async def _watch_engine(self) -> None:
        assert self.client is not None
        status = await self.client.wait_for_exit()
        if not self.is_shutting_down:
            logger.error("the engine process (pid %s) died with status %s", self.client.pid, status)
            self._fail_everything(EngineDeadError(f"the engine process died (exit status {status})"))

    def _fail_everything(self, error: EngineDeadError) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = error
        for stream in self.streams.values():
            stream.put(error)
        self.streams.clear()
        self.num_engine_requests = 0
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(error)
        for callback in self.on_engine_dead:
            callback(error)

    # ------------------------------------------------------------------------------ shutdown
    async def shutdown(self, timeout: float = 5.0) -> None:
        """Abort whatever is still in flight, stop the engine process and reap it."""
        if self.is_shutting_down:
            return
        self.is_shutting_down = True
        for request_id in list(self.streams):
            stream = self.streams[request_id]
            self.abort(request_id)
            stream.put(EngineDeadError("the server is shutting down"))
        await asyncio.gather(*self._background_sends, return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.client is not None:
            await self.client.shutdown(timeout=timeout)
