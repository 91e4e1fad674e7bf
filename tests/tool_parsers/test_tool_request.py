"""What a chat request's tools and tool_choice resolve to, and the 400s (naming the field) for bad ones, without a
server; the server flags' checks."""
from __future__ import annotations

import json

import jsonschema
import pytest

from pagedserve.cli import main
from pagedserve.config.tool_calling import ToolCallingConfig
from pagedserve.server.errors import OpenAIError
from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.tool_calling import resolve_tool_request
from pagedserve.tool_parsers.constrained_tool_calls import required_tool_calls_schema

AUTO = ToolCallingConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}}, "required": ["street"]}
SHIP_PARAMETERS = {"type": "object", "properties": {"to": {"$ref": "#/$defs/address"}}, "required": ["to"],
                   "$defs": {"address": ADDRESS}}
TOOLS = [{"type": "function", "function": {"name": "ship", "parameters": SHIP_PARAMETERS}},
         {"type": "function", "function": {"name": "ping"}}]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"messages": [{"role": "user", "content": "hi"}], **fields})


def refusal(body: ChatCompletionRequest, config: ToolCallingConfig = AUTO) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        resolve_tool_request(body, config)
    assert caught.value.status_code == 400
    return caught.value


def test_the_default_choice_is_auto_with_tools_and_none_without():
    assert resolve_tool_request(request(tools=TOOLS), AUTO).mode == "auto"
    assert resolve_tool_request(request(), AUTO).mode == "none"
    none = resolve_tool_request(request(tools=TOOLS, tool_choice="none"), ToolCallingConfig())
    assert none.tools == TOOLS and none.new_parser() is None and none.structured_outputs() is None


def test_special_token_markers_are_kept_for_their_parsers():
    def resolved(parser: str, tool_choice: str = "auto"):
        config = ToolCallingConfig(enable_auto_tool_choice=True, tool_call_parser=parser)
        return resolve_tool_request(request(tools=TOOLS, tool_choice=tool_choice), config)

    assert resolved("deepseek_v3").needs_special_tokens and resolved("llama3_json").needs_special_tokens
    assert not resolved("hermes").needs_special_tokens and not resolved("deepseek_v3", "none").needs_special_tokens


def test_auto_needs_the_server_flags_as_in_vllm():
    error = refusal(request(tools=TOOLS), ToolCallingConfig())
    assert error.param == "tool_choice" and "--enable-auto-tool-choice" in error.message
    assert "--tool-call-parser" in error.message


@pytest.mark.parametrize("fields, param, needle", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "'name'"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "retrieval"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "missing"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters", "type 'object'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}]},
     "tools[0].function.parameters", "'not'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
     "tools[0].function.description", "string"),
])
def test_bad_tools_name_the_field(fields, param, needle):
    error = refusal(request(**fields))
    assert error.param == param and needle in error.message, error.message


def test_required_schema_accepts_exactly_the_tools_calls():
    schema = required_tool_calls_schema(TOOLS)
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"] and "address" in schema["$defs"]
    jsonschema.validate([{"name": "ship", "parameters": {"to": {"street": "Main"}}},
                         {"name": "ping", "parameters": {}}], schema)
    for bad in ([], [{"name": "ship", "parameters": {"to": {}}}], [{"name": "pong", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_tool_calls_schema(TOOLS, parallel_tool_calls=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "ping", "parameters": {}}] * 2, single)
    # The grammar is the schema the engine gets.
    forced = resolve_tool_request(request(tools=TOOLS, tool_choice="required"), ToolCallingConfig())
    assert json.loads(forced.structured_outputs().spec) == schema


def test_a_named_function_is_constrained_by_its_parameters():
    named = resolve_tool_request(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ship"}}),
                                 ToolCallingConfig())
    assert json.loads(named.structured_outputs().spec) == SHIP_PARAMETERS


def test_assistant_tool_calls_reach_the_template_with_dict_arguments():
    body = request(messages=[
        {"role": "user", "content": "ship it"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "ship", "arguments": '{"to": {"street": "A"}}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "shipped"}])
    messages = body.template_messages()
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"to": {"street": "A"}}
    assert messages[2]["tool_call_id"] == "call-1"


def test_server_flags_are_checked_before_anything_starts(capsys):
    assert main(["serve", "--tool-call-parser", "nope"]) == 2
    assert "tool_call_parser='nope' must be one of" in capsys.readouterr().err
    assert main(["serve", "--enable-auto-tool-choice"]) == 2
    assert "--tool-call-parser" in capsys.readouterr().err
