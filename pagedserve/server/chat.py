"""POST /v1/chat/completions: messages through the model's chat template, then one engine request.

Streaming sends, per choice, a first chunk with the assistant role, then content deltas; the chunk
that finishes a choice carries its finish_reason; an optional usage chunk precedes `data: [DONE]`.
With a reasoning parser (--reasoning-parser) the model's thinking goes to `reasoning_content`, apart from
`content`, streamed in its own deltas (pagedserve/reasoning/).
With tools (server/tool_calling.py) the chat template gets them, and the content after any reasoning is read for
tool calls (pagedserve/tool_parsers/): `tool_calls` in the message, or streamed as deltas that carry a call's
id, type and name first, then its argument fragments; a choice that called tools finishes with "tool_calls" (with "stop" when tool_choice named the function, as OpenAI).
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedserve.engine.async_llm import DuplicateRequestError, EngineDeadError, RequestStream
from pagedserve.outputs import CompletionOutput
from pagedserve.reasoning.reasoning_parser import ReasoningParser, get_reasoning_parser
from pagedserve.server.chat_answer import AnswerStream, parse_answer
from pagedserve.server.disconnect import run_until_disconnected
from pagedserve.server.errors import OpenAIError, error_body
from pagedserve.server.logprobs_format import chat_logprobs
from pagedserve.server.protocol import (ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionChunk,
                                        ChatCompletionRequest, ChatCompletionResponse,
                                        ChatStreamChoice, ChatTokenLogprob, DeltaMessage, UsageInfo)
from pagedserve.server.request_ids import REQUEST_ID_HEADER, base_request_id, chat_request_id, duplicate_request_error
from pagedserve.server.state import ServerState
from pagedserve.server.streaming import SSE_DONE, SSE_HEADERS, sse_event
from pagedserve.server.tool_calling import ToolRequest, resolve_tool_request


@dataclass
class _ChatChoice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[ChatTokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatHandler:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine = state.engine
        name = self.engine.config.structured_outputs_config.reasoning_parser
        self.reasoning_parser: ReasoningParser | None = None if name is None else get_reasoning_parser(name)

    def decode(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def prompt_token_ids(self, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The rendered conversation's token ids; a template that rejects the messages is a 400."""
        messages = body.template_messages()
        template_kwargs = dict(body.chat_template_kwargs or {})
        if tools is not None:
            template_kwargs["tools"] = tools
        try:
            return self.engine.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                   chat_template=body.chat_template, **template_kwargs)
        except ValueError:
            raise
        except Exception as error:  # jinja2 errors: the template refused these messages
            raise ValueError(f"messages could not be rendered by the chat template: {error}") from None

    async def create(self, body: ChatCompletionRequest, raw_request: Request) -> Response:
        model_name = self.state.resolve_model(body.model)
        num_top = body.top_logprobs or 0
        tool_request = resolve_tool_request(body, self.state.tool_calling)
        params = body.sampling_params(max_tokens=body.effective_max_tokens(),
                                      logprobs=num_top if body.logprobs else None)
        tool_constraint = tool_request.structured_outputs()
        if tool_constraint is not None:
            params = dataclasses.replace(params, structured_outputs=tool_constraint)
        if tool_request.needs_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        prompt_token_ids = self.prompt_token_ids(body, tool_request.tools)
        self.state.admit(params.n)
        base_id = base_request_id(raw_request.headers.get(REQUEST_ID_HEADER), body.request_id)
        request_id = chat_request_id(base_id)
        try:
            stream = await self.engine.add_request(request_id, {"prompt_token_ids": prompt_token_ids}, params,
                                                   priority=body.priority)
        except DuplicateRequestError:
            raise duplicate_request_error(base_id) from None
        created = int(time.time())
        if body.stream:
            return StreamingResponse(self._stream(body, tool_request, request_id, model_name, created, stream),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        return await run_until_disconnected(raw_request, self._full(body, tool_request, request_id, model_name,
                                                                    created, stream))

    def _delta_logprobs(self, body: ChatCompletionRequest,
                        completion: CompletionOutput) -> list[ChatTokenLogprob] | None:
        if not body.logprobs or completion.logprobs is None:
            return None
        return chat_logprobs(completion.token_ids, completion.logprobs, body.top_logprobs or 0, self.decode)

    async def _full(self, body: ChatCompletionRequest, tool_request: ToolRequest, request_id: str, model_name: str,
                    created: int, stream: RequestStream) -> Response:
        choices = [_ChatChoice() for _ in range(body.n)]
        kv_transfer_params = None
        try:
            async for output in stream.stream():
                if output.kv_transfer_params is not None:
                    kv_transfer_params = output.kv_transfer_params
                for completion in output.outputs:
                    choice = choices[completion.index]
                    choice.text.append(completion.text)
                    choice.token_ids.extend(completion.token_ids)
                    delta_logprobs = self._delta_logprobs(body, completion)
                    if delta_logprobs is not None:
                        choice.logprobs = (choice.logprobs or []) + delta_logprobs
                    if completion.finish_reason is not None:
                        choice.finish_reason = completion.finish_reason
                        choice.stop_reason = completion.stop_reason
        except EngineDeadError as error:
            raise OpenAIError(503, f"the engine failed while generating: {error}") from None
        num_completion_tokens = sum(len(choice.token_ids) for choice in choices)
        messages = [parse_answer("".join(choice.text), self.reasoning_parser,
                                 tool_request.new_parser(self.engine.tokenizer)) for choice in choices]
        response = ChatCompletionResponse(
            id=request_id, created=created, model=model_name,
            choices=[ChatCompletionChoice(
                index=index, message=message,
                logprobs=ChatChoiceLogprobs(content=choice.logprobs or []) if body.logprobs else None,
                finish_reason=_finish_reason(choice.finish_reason, bool(message.tool_calls), tool_request),
                stop_reason=choice.stop_reason, token_ids=choice.token_ids if body.return_token_ids else None)
                for index, (choice, message) in enumerate(zip(choices, messages))],
            usage=UsageInfo(prompt_tokens=stream.num_prompt_tokens, completion_tokens=num_completion_tokens,
                            total_tokens=stream.num_prompt_tokens + num_completion_tokens),
            kv_transfer_params=kv_transfer_params)
        return JSONResponse(response.model_dump())

    async def _stream(self, body: ChatCompletionRequest, tool_request: ToolRequest, request_id: str,
                      model_name: str, created: int, stream: RequestStream):
        options = body.stream_options
        include_usage = options is not None and options.include_usage
        continuous_usage = include_usage and options is not None and options.continuous_usage_stats
        num_prompt_tokens = stream.num_prompt_tokens
        num_completion_tokens = 0
        answers = [AnswerStream(self.reasoning_parser, tool_request.new_parser(self.engine.tokenizer))
                   for _ in range(body.n)]

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse_event(ChatCompletionChunk(id=request_id, created=created, model=model_name, choices=choices,
                                                 usage=usage).model_dump_json())

        def usage() -> UsageInfo:
            return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                             total_tokens=num_prompt_tokens + num_completion_tokens)

        try:
            try:
                # The role comes first, once per choice, before any content (OpenAI's order).
                for index in range(body.n):
                    yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))],
                                usage() if continuous_usage else None)
                async for output in stream.stream():
                    chunk_choices = []
                    for completion in output.outputs:
                        num_completion_tokens += len(completion.token_ids)
                        if not completion.text and completion.finish_reason is None and not (
                                body.logprobs or body.return_token_ids):
                            continue  # e.g. half a UTF-8 character: OpenAI sends no empty content deltas
                        delta_logprobs = self._delta_logprobs(body, completion)
                        is_final = completion.finish_reason is not None
                        answer = answers[completion.index]
                        if answer.reasoning_stream is None and answer.tool_parser is None:
                            delta = DeltaMessage(content=completion.text)
                        else:
                            delta = answer.feed(completion.text, is_final)
                            if not (delta.content or delta.reasoning_content or delta.tool_calls or is_final
                                    or body.logprobs or body.return_token_ids):
                                continue  # a tag still arriving: nothing certain to send yet
                        chunk_choices.append(ChatStreamChoice(
                            index=completion.index, delta=delta,
                            logprobs=ChatChoiceLogprobs(content=delta_logprobs) if delta_logprobs is not None else None,
                            finish_reason=_finish_reason(completion.finish_reason, answer.called_tools, tool_request),
                            stop_reason=completion.stop_reason,
                            token_ids=list(completion.token_ids) if body.return_token_ids else None))
                    if chunk_choices:
                        yield chunk(chunk_choices, usage() if continuous_usage else None)
                if include_usage:
                    yield chunk([], usage())
            except EngineDeadError as error:
                yield sse_event(json.dumps(error_body(503, f"the engine failed while generating: {error}")))
            yield SSE_DONE

        finally:
            stream.close()


def _finish_reason(finish_reason: str | None, called_tools: bool, tool_request: ToolRequest) -> str | None:
    """OpenAI's: "tool_calls" for a choice that stopped after calling tools with tool_choice "auto" or "required",
    but "stop" for a named function (the caller forced that call); a cut-off one stays "length"."""
    forced = tool_request.mode == "named"
    return "tool_calls" if called_tools and finish_reason == "stop" and not forced else finish_reason
