"""Tool calling with calls a real model writes itself: the default model (SmolLM2) through the OpenAI server, with
the real openai client. Slow (SmolLM2 on 2 cores); test_tool_calling_server.py covers the same server code on a
tiny model, and test_tool_parsers.py the parsers and the reasoning-then-tools split.

One server: `--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`. SmolLM2 was not
trained on tools, but it continues a few-shot pattern: the request's chat template renders examples of hermes
calls and the request's `tools` (so the template must receive them), and the model writes a call the same way.
"""
from __future__ import annotations

import os
import sys

import openai
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "server"))
from server_process import ServerProcess  # noqa: E402

pytestmark = pytest.mark.slow

WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                      "required": ["city", "days"], "additionalProperties": False}
TIME_PARAMETERS = {"type": "object", "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
                   "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast of a city",
                                           "parameters": WEATHER_PARAMETERS}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}}]


def _few_shot(answer_prefix: str) -> str:
    examples = "".join(
        f"Tools: get_weather, get_time\nQ: {question}\nA:{answer_prefix}<tool_call>{call}</tool_call>\n"
        for question, call in (
            ("What is the weather in Rome?", '{"name": "get_weather", "arguments": {"city": "Rome"}}'),
            ("What time is it in Tokyo?", '{"name": "get_time", "arguments": {"city": "Tokyo"}}'),
            ("What is the weather in Oslo?", '{"name": "get_weather", "arguments": {"city": "Oslo"}}')))
    return ("{% raw %}" + examples + "{% endraw %}Tools: {{ tools | map(attribute='function.name') | join(', ') }}\n"
            "Q: {{ messages[-1]['content'] }}\nA:")


TEMPLATE = _few_shot("")
THINKING_TEMPLATE = _few_shot("<think>The user wants data.</think>")
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("smollm2-135m-instruct", [
        "--max-model-len", "1024", "--num-kv-blocks", "128",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"])
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _create(client, stream: bool, **kwargs):
    return client.chat.completions.create(model=client.models.list().data[0].id, temperature=0, stream=stream,
                                          **kwargs)


def _reassemble(chunks) -> tuple[dict[str, str], list[tuple[str, str]], str | None, list[str]]:
    """(text fields, [(name, arguments)], finish_reason, the order of delta kinds) of a stream. Checks OpenAI's
    shape: a call's first delta has its id, type and name; later ones only argument fragments."""
    texts = {"content": "", "reasoning_content": ""}
    calls: dict[int, list[str]] = {}
    finish_reason = None
    kinds = []
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            for field in texts:
                text = getattr(delta, field, None) or (delta.model_extra or {}).get(field)
                if text:
                    texts[field] += text
                    kinds.append(field)
            for call in delta.tool_calls or []:
                if call.index not in calls:
                    assert call.id.startswith("chatcmpl-tool-") and call.type == "function" and call.function.name
                    calls[call.index] = [call.function.name, ""]
                else:
                    assert call.id is None and call.function.name is None
                calls[call.index][1] += call.function.arguments or ""
                kinds.append("tool_calls")
            finish_reason = choice.finish_reason or finish_reason
    return texts, [(name, arguments) for name, arguments in (calls[i] for i in sorted(calls))], finish_reason, kinds


def _calls(message) -> list[tuple[str, str]]:
    for call in message.tool_calls or []:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


def test_auto_finds_the_models_call_streamed_and_not(client):
    request = dict(messages=QUESTION, tools=TOOLS, max_tokens=32, stop=["\n"], extra_body={"chat_template": TEMPLATE})
    whole = _create(client, False, **request)
    message = whole.choices[0].message
    assert _calls(message) == [("get_weather", '{"city": "Paris"}')] and message.content is None
    assert whole.choices[0].finish_reason == "tool_calls"
    texts, calls, finish_reason, _ = _reassemble(_create(client, True, **request))
    assert calls == _calls(message) and texts["content"] == "" and finish_reason == "tool_calls"


def test_reasoning_comes_first_then_the_calls(client):
    request = dict(messages=QUESTION, tools=TOOLS, max_tokens=40, stop=["\n"],
                   extra_body={"chat_template": THINKING_TEMPLATE})
    message = _create(client, False, **request).choices[0].message
    assert message.model_extra["reasoning_content"] == "The user wants data."
    assert len(_calls(message)) == 1 and message.content is None
    texts, calls, finish_reason, kinds = _reassemble(_create(client, True, **request))
    assert texts["reasoning_content"] == "The user wants data." and calls == _calls(message)
    assert kinds == sorted(kinds, key=lambda kind: kind == "tool_calls") and finish_reason == "tool_calls"


def test_none_leaves_the_output_as_content_and_the_template_still_gets_the_tools(client):
    request = dict(messages=QUESTION, tools=TOOLS, tool_choice="none", max_tokens=32, stop=["\n"],
                   extra_body={"chat_template": TEMPLATE})
    whole = _create(client, False, **request)
    message = whole.choices[0].message
    assert message.tool_calls is None and message.content.startswith("<tool_call>")
    assert whole.choices[0].finish_reason == "stop"
    # The template rendered the tools: one tool less is a shorter prompt.
    fewer = _create(client, False, **{**request, "tools": TOOLS[:1], "max_tokens": 1})
    assert fewer.usage.prompt_tokens < whole.usage.prompt_tokens
