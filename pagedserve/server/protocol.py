"""OpenAI API request and response bodies (pydantic), plus vLLM's extra sampling fields.

Requests accept what the official openai client sends; fields OpenAI defines but pagedserve does not
implement (logit_bias, suffix, best_of != n) are rejected with a 400 rather than ignored, so a
client never silently gets something other than what it asked for. Unknown extra fields are ignored,
like OpenAI's server does. Numbers the engine cannot take (an integer beyond 64 bits, NaN or Infinity,
which Python's JSON parser reads although JSON has neither) are a 400 naming the field, value and limit.
"""
from __future__ import annotations

import json
import math
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.sampling_params import MAX_LOGPROBS, SamplingParams
from pagedserve.structured_output.grammar_validation import validate_structured_outputs
from pagedserve.structured_output.structured_outputs_params import StructuredOutputsParams

# Integer request fields go to the engine as 64-bit signed integers (msgpack messages, int64 tensors).
# seed has its own range, the sampler's (SamplingParams checks it).
MIN_REQUEST_INT = -(2 ** 63)
MAX_REQUEST_INT = 2 ** 63 - 1


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ------------------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: str | None = None
    description: str | None = None
    # OpenAI's field is `schema`; pydantic reserves that name on models.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's response_format: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(OpenAIModel):
    """Sampling knobs shared by completions and chat (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    priority: int = 0
    # vLLM extension: also return the generated token ids (choices[].token_ids).
    return_token_ids: bool = False
    response_format: ResponseFormat | None = None
    # vLLM extension: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}.
    structured_outputs: dict[str, Any] | None = None
    # vLLM extension for prefill/decode disaggregation: handed to the engine's KV connector (to P:
    # {"do_remote_decode": true}; to D: what P's response returned). pagedserve/kv_transfer/kv_transfer_params.py.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM extension: the caller's id for the request (the X-Request-Id header wins); server/request_ids.py.
    request_id: str | None = None

    def check_numbers(self) -> None:
        """ValueError naming the field, value and limit for an integer beyond 64 bits or a float that is not
        finite (NaN, Infinity, or a literal such as 1e999 that overflows to Infinity)."""
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, bool) or name == "seed":
                continue
            if isinstance(value, int) and not MIN_REQUEST_INT <= value <= MAX_REQUEST_INT:
                raise ValueError(f"{name}={value} is outside [{MIN_REQUEST_INT}, {MAX_REQUEST_INT}], the range of "
                                 "64-bit integers this server takes")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name}={value} must be a finite number")

    def check_unsupported(self) -> None:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported: it must equal n={self.n} or be omitted")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream=true")

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint from response_format or structured_outputs (ValueError names the field)."""
        response_format = self.response_format
        if response_format is not None and response_format.type != "text":
            if self.structured_outputs is not None:
                raise ValueError("response_format and structured_outputs both constrain the output: give one")
            if response_format.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if response_format.json_schema is None or response_format.json_schema.json_schema is None:
                raise ValueError("response_format.json_schema.schema is missing: type 'json_schema' needs a schema")
            params = StructuredOutputsParams(json=response_format.json_schema.json_schema)
            validate_structured_outputs(params, "response_format.json_schema.schema")
            return params
        if self.structured_outputs is None:
            return None
        unknown = sorted(set(self.structured_outputs) - {"json", "regex", "choice", "grammar", "json_object"})
        if unknown:
            raise ValueError(f"structured_outputs has unknown keys {unknown}; allowed: json, regex, choice, grammar, "
                             f"json_object")
        params = StructuredOutputsParams(**self.structured_outputs)
        validate_structured_outputs(params, f"structured_outputs.{params.kind}")
        return params

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The SamplingParams of this request (ValueError names any bad field and its range)."""
        self.check_numbers()
        self.check_unsupported()
        values: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_outputs_params())
        if self.kv_transfer_params is not None:
            values["extra_args"] = {"kv_transfer_params": self.kv_transfer_params}
        for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", -1), ("min_p", 0.0),
                              ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = getattr(self, name)
            values[name] = default if value is None else value
        return SamplingParams(**values)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise ValueError("suffix is not supported by this server")


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # An assistant turn's calls and a tool turn's answer to one of them (multi-turn tool use).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calling (pagedserve/server/tool_calling.py checks these): OpenAI's function tools and the choice among
    # them, "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=true")
        # These reach SamplingParams under other names (logprobs, max_tokens): name the field the client sent.
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs={self.top_logprobs} must be an integer in [0, {MAX_LOGPROBS}]")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise ValueError(f"max_completion_tokens={self.max_completion_tokens} must be an integer >= 1")

    def effective_max_tokens(self) -> int | None:
        """max_completion_tokens (the newer name) wins over max_tokens; None means 'fill the context'."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template wants them: content parts of type 'text' joined into one string."""
        if not self.messages:
            raise ValueError("messages=[] is empty: give at least one message")
        messages: list[dict[str, Any]] = []
        for index, message in enumerate(self.messages):
            content = message.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise ValueError(f"messages[{index}].content part {part!r} is not supported: "
                                         "only {'type': 'text', 'text': ...} parts are")
                    texts.append(part["text"])
                content = "\n".join(texts)
            entry: dict[str, Any] = {"role": message.role, "content": content or ""}
            if message.name is not None:
                entry["name"] = message.name
            if message.tool_calls is not None:
                entry["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            messages.append(entry)
        return messages


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool call for the chat template: arguments as a dict (templates such as Qwen's and
    Llama's write `arguments | tojson`), as vLLM renders them; arguments that are not a JSON object stay text."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    # The chat template renders these with `messages`, as for a chat request.
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


# ------------------------------------------------------------------------------------- responses
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    # A KV producer's answer to {"do_remote_decode": true}: what the decode instance pulls the KV with (vLLM's field).
    kv_transfer_params: dict[str, Any] | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    # The arguments as JSON text, as the model wrote them.
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed call: its first delta has id, type and the function's name; later ones argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    # With --reasoning-parser: the model's thinking, apart from the answer (vLLM's field).
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    # A KV producer's answer to {"do_remote_decode": true} (as in CompletionResponse).
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
