"""POST /v1/completions: one engine request per prompt, streamed as SSE or answered whole.

Choice indices follow OpenAI/vLLM: prompt i's n outputs are choices i*n .. i*n+n-1.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedserve.engine.async_llm import AsyncLLM, DuplicateRequestError, EngineDeadError, RequestStream
from pagedserve.engine.input_processor import PromptType
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.server.disconnect import run_until_disconnected
from pagedserve.server.errors import OpenAIError, error_body
from pagedserve.server.logprobs_format import append_completion_logprobs
from pagedserve.server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                                        CompletionStreamResponse, UsageInfo)
from pagedserve.server.request_ids import (REQUEST_ID_HEADER, base_request_id, completion_prompt_request_id,
                                           completion_request_id, duplicate_request_error)
from pagedserve.server.state import ServerState
from pagedserve.server.streaming import SSE_DONE, SSE_HEADERS, merge_streams, sse_event


def completion_prompts(prompt: Any) -> list[PromptType]:
    """OpenAI's four prompt shapes as engine prompts: str, [str], [int] (one prompt), [[int]]."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValueError("prompt=[] is empty: give a string, a list of strings, or token ids")
    if all(isinstance(item, int) for item in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    if all(isinstance(item, str) for item in prompt):
        return list(prompt)
    if all(isinstance(item, list) for item in prompt):
        return [{"prompt_token_ids": list(ids)} for ids in prompt]
    raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists")


async def add_streams(engine: AsyncLLM, base_id: str, prompts: list[PromptType], params: Any,
                      priority: int) -> list[RequestStream]:
    """Add one engine request per prompt; on a bad prompt nothing stays queued (ValueError names it)."""
    streams: list[RequestStream] = []
    try:
        for index, prompt in enumerate(prompts):
            try:
                streams.append(await engine.add_request(completion_prompt_request_id(base_id, index), prompt,
                                                        params, priority=priority))
            except DuplicateRequestError:
                raise
            except ValueError as error:
                raise ValueError(f"prompt[{index}]: {error}" if len(prompts) > 1 else str(error)) from None
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams


@dataclass
class _Choice:
    """One choice being assembled from delta outputs."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: CompletionLogprobs | None = None
    text_offset: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    is_started: bool = False


class CompletionHandler:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine = state.engine

    def decode(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    async def create(self, body: CompletionRequest, raw_request: Request) -> Response:
        model_name = self.state.resolve_model(body.model)
        prompts = completion_prompts(body.prompt)
        if body.kv_transfer_params is not None and len(prompts) > 1:
            raise ValueError(f"kv_transfer_params is given with {len(prompts)} prompts: a request that hands its KV "
                             "to (or takes it from) another instance has one prompt")
        logprobs = body.logprobs
        params = body.sampling_params(max_tokens=body.max_tokens, logprobs=logprobs,
                                      prompt_logprobs=logprobs if body.echo and logprobs is not None else None)
        self.state.admit(len(prompts) * params.n)
        base_id = base_request_id(raw_request.headers.get(REQUEST_ID_HEADER), body.request_id)
        request_id = completion_request_id(base_id)
        try:
            streams = await add_streams(self.engine, base_id, prompts, params, body.priority)
        except DuplicateRequestError:
            raise duplicate_request_error(base_id) from None
        created = int(time.time())
        if body.stream:
            return StreamingResponse(self._stream(body, request_id, model_name, created, streams),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        return await run_until_disconnected(raw_request,
                                            self._full(body, request_id, model_name, created, streams))

    # ----------------------------------------------------------------------------------------
    def _fold(self, body: CompletionRequest, choice: _Choice, output: RequestOutput,
              completion: CompletionOutput) -> tuple[str, list[int], CompletionLogprobs | None]:
        """Fold one delta into `choice`; returns the delta's text, token ids and logprobs (echo included)."""
        text = completion.text
        token_ids = list(completion.token_ids)
        delta_logprobs = CompletionLogprobs() if body.logprobs is not None else None
        if not choice.is_started:
            choice.is_started = True
            if body.echo:
                prompt_text = output.prompt if output.prompt is not None else self.engine.tokenizer.decode(
                    output.prompt_token_ids, skip_special_tokens=body.skip_special_tokens)
                text = prompt_text + text
                if delta_logprobs is not None:
                    rows = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
                    choice.text_offset = append_completion_logprobs(
                        delta_logprobs, output.prompt_token_ids, rows, body.logprobs or 0, self.decode,
                        choice.text_offset)
        if delta_logprobs is not None and completion.logprobs is not None:
            choice.text_offset = append_completion_logprobs(
                delta_logprobs, completion.token_ids, completion.logprobs, body.logprobs or 0, self.decode,
                choice.text_offset)
        choice.text.append(text)
        choice.token_ids.extend(token_ids)
        if delta_logprobs is not None:
            if choice.logprobs is None:
                choice.logprobs = CompletionLogprobs()
            for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
                getattr(choice.logprobs, name).extend(getattr(delta_logprobs, name))
        if completion.finish_reason is not None:
            choice.finish_reason = completion.finish_reason
            choice.stop_reason = completion.stop_reason
        return text, token_ids, delta_logprobs

    async def _full(self, body: CompletionRequest, request_id: str, model_name: str, created: int,
                    streams: list[RequestStream]) -> Response:
        n = body.n
        choices = [_Choice() for _ in range(len(streams) * n)]
        kv_transfer_params = None
        try:
            async for prompt_index, output in merge_streams(streams):
                for completion in output.outputs:
                    self._fold(body, choices[prompt_index * n + completion.index], output, completion)
                if output.kv_transfer_params is not None:
                    kv_transfer_params = output.kv_transfer_params
        except EngineDeadError as error:
            raise OpenAIError(503, f"the engine failed while generating: {error}") from None
        num_prompt_tokens = sum(stream.num_prompt_tokens for stream in streams)
        num_completion_tokens = sum(len(choice.token_ids) for choice in choices)
        response = CompletionResponse(
            id=request_id, created=created, model=model_name,
            choices=[CompletionChoice(index=index, text="".join(choice.text), logprobs=choice.logprobs,
                                      finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
                                      token_ids=choice.token_ids if body.return_token_ids else None)
                     for index, choice in enumerate(choices)],
            usage=UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                            total_tokens=num_prompt_tokens + num_completion_tokens),
            kv_transfer_params=kv_transfer_params)
        return JSONResponse(response.model_dump(exclude_none=False))

    async def _stream(self, body: CompletionRequest, request_id: str, model_name: str, created: int,
                      streams: list[RequestStream]):
        n = body.n
        choices = [_Choice() for _ in range(len(streams) * n)]
        options = body.stream_options
        include_usage = options is not None and options.include_usage
        continuous_usage = include_usage and options is not None and options.continuous_usage_stats
        num_prompt_tokens = sum(stream.num_prompt_tokens for stream in streams)
        num_completion_tokens = 0
        try:
            async for prompt_index, output in merge_streams(streams):
                chunk_choices = []
                for completion in output.outputs:
                    index = prompt_index * n + completion.index
                    text, token_ids, logprobs = self._fold(body, choices[index], output, completion)
                    num_completion_tokens += len(token_ids)
                    if not text and not token_ids and completion.finish_reason is None:
                        continue
                    chunk_choices.append(CompletionChoice(
                        index=index, text=text, logprobs=logprobs, finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason, token_ids=token_ids if body.return_token_ids else None))
                if not chunk_choices:
                    continue
                chunk = CompletionStreamResponse(id=request_id, created=created, model=model_name,
                                                 choices=chunk_choices)
                if continuous_usage:
                    chunk.usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                                            total_tokens=num_prompt_tokens + num_completion_tokens)
                yield sse_event(chunk.model_dump_json())
            if include_usage:
                final = CompletionStreamResponse(
                    id=request_id, created=created, model=model_name, choices=[],
                    usage=UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                                    total_tokens=num_prompt_tokens + num_completion_tokens))
                yield sse_event(final.model_dump_json())
        except EngineDeadError as error:
            yield sse_event(json.dumps(error_body(503, f"the engine failed while generating: {error}")))
        yield SSE_DONE
