"""Tool calling through the OpenAI server with the real openai client, on a tiny random model (fast).

The server runs `--enable-auto-tool-choice --tool-call-parser hermes`. tool_choice "required" and named functions
are enforced by the grammar, so even random weights produce calls whose arguments validate against the tool's
schema. For "auto", the model must write a call itself: a request's `structured_outputs` choice makes the tiny
model write a given text, which the hermes parser then reads in the server, whole and streamed.
(test_tool_calling_few_shot.py, marked slow, has SmolLM2 write its calls from a few-shot template.)
"""
from __future__ import annotations

import json
import os
import sys

import httpx
import jsonschema
import openai
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "server"))
from server_process import ServerProcess  # noqa: E402

MAX_BODY_BYTES = 64 * 1024
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                      "required": ["city", "days"], "additionalProperties": False}
TIME_PARAMETERS = {"type": "object", "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
                   "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast of a city",
                                           "parameters": WEATHER_PARAMETERS}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
# Room for the longest call the schemas allow (a city of 6 characters, each up to 4 byte tokens, the JSON around it),
# so a forced call always ends before max_tokens, whatever random weights pick.
MAX_CALL_TOKENS = 112
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
# A template that renders the tools: the prompt grows with them.
TOOLS_TEMPLATE = ("{% for tool in tools %}{{ tool.function.name }}: {{ tool.function.description }}\n{% endfor %}"
                  "{% for message in messages %}{{ message['content'] }}\n{% endfor %}")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    process = ServerProcess(tiny_model_dir("llama"), [
        "--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "64", "--block-size", "16",
        "--max-body-bytes", str(MAX_BODY_BYTES), "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    yield client
    client.close()  # no idle keep-alive connection for the server's shutdown to wait out


def create(client: openai.OpenAI, stream: bool, **kwargs):
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, temperature=0,
                                          stream=stream, **kwargs)


def message_calls(message) -> list[tuple[str, str]]:
    for call in message.tool_calls or []:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


def reassemble(chunks) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) of a stream, checking OpenAI's shape: a call's first delta
    has its id, type and name; later deltas only argument fragments."""
    content = ""
    calls: dict[int, list[str]] = {}
    finish_reason = None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.index not in calls:
                    assert call.id.startswith("chatcmpl-tool-") and call.type == "function" and call.function.name
                    calls[call.index] = [call.function.name, ""]
                else:
                    assert call.id is None and call.function.name is None
                calls[call.index][1] += call.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return content or None, [(name, arguments) for name, arguments in calls.values()], finish_reason


def test_auto_parses_the_models_call_streamed_and_not(client):
    request = dict(tools=TOOLS, max_tokens=160, extra_body={"structured_outputs": {"choice": [HERMES_CALL]}})
    whole = create(client, False, **request)
    message = whole.choices[0].message
    assert message.content == "Checking." and whole.choices[0].finish_reason == "tool_calls"
    assert message_calls(message) == [("get_weather", '{"city": "Paris", "days": 2}')]
    assert reassemble(create(client, True, **request)) == ("Checking.", message_calls(message), "tool_calls")


@pytest.mark.parametrize("text", ["It is sunny.", '<tool_call>{"name": get_weather}</tool_call>'],
                         ids=["plain-answer", "malformed-call"])
def test_auto_without_a_well_formed_call_is_content(client, text):
    request = dict(tools=TOOLS, max_tokens=80, extra_body={"structured_outputs": {"choice": [text]}})
    whole = create(client, False, **request)
    assert whole.choices[0].message.content == text and whole.choices[0].message.tool_calls is None
    assert whole.choices[0].finish_reason == "stop"
    assert reassemble(create(client, True, **request)) == (text, [], "stop")


def test_named_function_arguments_follow_its_schema_streamed_and_not(client):
    request = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   max_tokens=MAX_CALL_TOKENS)
    whole = create(client, False, **request)
    calls = message_calls(whole.choices[0].message)
    # A forced (named) call finishes with "stop", as OpenAI's and vLLM's do; auto and required with "tool_calls".
    assert [name for name, _ in calls] == ["get_weather"] and whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(calls[0][1]), WEATHER_PARAMETERS)
    assert reassemble(create(client, True, **request)) == (None, calls, "stop")


def test_required_calls_follow_their_tools_schemas_streamed_and_not(client):
    # One call (parallel_tool_calls=false): random weights would otherwise add calls until max_tokens.
    request = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=MAX_CALL_TOKENS)
    whole = create(client, False, **request)
    calls = message_calls(whole.choices[0].message)
    assert len(calls) == 1 and whole.choices[0].finish_reason == "tool_calls"
    assert whole.choices[0].message.content is None
    jsonschema.validate(json.loads(calls[0][1]), SCHEMAS[calls[0][0]])
    assert reassemble(create(client, True, **request)) == (None, calls, "tool_calls")


def test_none_answers_with_content_and_the_template_gets_the_tools(client):
    request = dict(tools=TOOLS, tool_choice="none", max_tokens=1, extra_body={"chat_template": TOOLS_TEMPLATE})
    whole = create(client, False, **request)
    assert whole.choices[0].message.tool_calls is None and whole.choices[0].finish_reason == "length"
    fewer = create(client, False, **{**request, "tools": TOOLS[1:]})
    assert fewer.usage.prompt_tokens < whole.usage.prompt_tokens


@pytest.mark.parametrize("change, param, needle", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice", "get_stock"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}]}, "tools[0].function.parameters", "strin"),
    ({"tools": [{"type": "function", "function": {"name": f"f{index}"}} for index in range(129)]}, "tools", "128"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", "bad name"),
    ({"tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "response_format"),
], ids=["unknown-tool", "invalid-schema", "too-many-tools", "bad-name", "bad-choice", "required-and-format"])
def test_bad_tools_are_400_naming_the_field(server, change, param, needle):
    body = {"messages": MESSAGES, "max_tokens": 1, "tools": TOOLS, **change}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"], error


def test_tools_over_the_body_limit_are_413_and_the_server_keeps_serving(server, client):
    tools = [{"type": "function", "function": {"name": f"tool_{index}", "description": "x" * 1000}}
             for index in range(100)]
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": MESSAGES, "tools": tools},
                          timeout=60)
    assert response.status_code == 413 and str(MAX_BODY_BYTES) in response.json()["error"]["message"]
    after = create(client, False, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                   max_tokens=MAX_CALL_TOKENS)
    jsonschema.validate(json.loads(message_calls(after.choices[0].message)[0][1]), TIME_PARAMETERS)
