"""What a chat request's `tools` and `tool_choice` ask for, checked before the engine sees the request.

- "none" (the default without tools): the answer is content; the template still gets the tools (vLLM's default).
- "auto" (the default with tools): the model decides; the server's --tool-call-parser finds the calls. It needs
  --enable-auto-tool-choice and a parser, else 400 (as vLLM).
- "required" / {"type": "function", "function": {"name": ...}}: a grammar forces the calls
  (tool_parsers/constrained_tool_calls.py), so their arguments always parse against the tool's schema.
Every refusal is a 400 whose `param` names the field.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pagedserve.config.tool_calling import ToolCallingConfig
from pagedserve.server.errors import OpenAIError
from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.structured_output.grammar_validation import validate_structured_outputs
from pagedserve.structured_output.structured_outputs_params import StructuredOutputsParams
from pagedserve.tool_parsers.constrained_tool_calls import (NamedFunctionParser, RequiredToolCallsParser,
                                                            named_function_schema, required_tool_calls_schema)
from pagedserve.tool_parsers.tool_parser import ToolParser
from pagedserve.tool_parsers.tool_parser_registry import TOOL_PARSERS, get_tool_parser

# OpenAI's limits: at most 128 functions, names of letters, digits, '_' and '-', up to 64 characters.
MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tool calling: `mode` is "none", "auto", "required" or "named"."""

    # The tools the chat template renders (in every mode, "none" included).
    tools: list[dict[str, Any]] | None
    mode: str
    function_name: str | None = None
    tool_call_parser: str | None = None
    parallel_tool_calls: bool = True

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar of "required" and named calls; None otherwise."""
        if self.mode == "named":
            tool = next(tool for tool in self.tools or [] if tool["function"]["name"] == self.function_name)
            return StructuredOutputsParams(json=named_function_schema(tool))
        if self.mode == "required":
            return StructuredOutputsParams(json=required_tool_calls_schema(self.tools or [], self.parallel_tool_calls))
        return None

    @property
    def needs_special_tokens(self) -> bool:
        """Whether the output must keep special tokens for the parser to see the calls' markers."""
        return self.mode == "auto" and self.tool_call_parser is not None and \
            TOOL_PARSERS[self.tool_call_parser].needs_special_tokens

    def new_parser(self, tokenizer: Any = None) -> ToolParser | None:
        """A parser for one output (None: no calls are looked for)."""
        if self.mode == "named":
            assert self.function_name is not None
            return NamedFunctionParser(self.function_name, tokenizer)
        if self.mode == "required":
            return RequiredToolCallsParser(tokenizer)
        if self.mode == "auto":
            assert self.tool_call_parser is not None
            return get_tool_parser(self.tool_call_parser, tokenizer, self.tools)
        return None


def resolve_tool_request(body: ChatCompletionRequest, config: ToolCallingConfig) -> ToolRequest:
    """The request's tool calling, or OpenAIError(400) naming the field at fault."""
    tools = body.tools or None
    if tools is not None:
        check_tools(tools)
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise OpenAIError(400, f"tool_choice={choice!r} must be one of {list(TOOL_CHOICES)} or "
                                   "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        mode, function_name = choice, None
    else:
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise OpenAIError(400, f"tool_choice={choice!r} must be {{'type': 'function', 'function': "
                                   "{'name': ...}} naming one of the tools", param="tool_choice")
        mode, function_name = "named", function["name"]
    if mode != "none" and tools is None:
        raise OpenAIError(400, f"tool_choice={choice!r} needs tools, but the request has none", param="tool_choice")
    if mode == "named":
        names = [tool["function"]["name"] for tool in tools or []]
        if function_name not in names:
            raise OpenAIError(400, f"tool_choice.function.name={function_name!r} is not one of the tools: {names}",
                              param="tool_choice")
    if mode == "auto" and not (config.enable_auto_tool_choice and config.tool_call_parser is not None):
        raise OpenAIError(400, 'tool_choice="auto" (the default when tools are given) needs the server started '
                               'with --enable-auto-tool-choice and --tool-call-parser; or ask for tool_choice '
                               '"required", a named function, or "none"', param="tool_choice")
    if mode in ("required", "named") and (body.structured_outputs is not None or (
            body.response_format is not None and body.response_format.type != "text")):
        raise OpenAIError(400, f"tool_choice={choice!r} constrains the output to tool calls, so it cannot be "
                               "combined with response_format or structured_outputs", param="tool_choice")
    request = ToolRequest(tools=tools, mode=mode, function_name=function_name,
                          tool_call_parser=config.tool_call_parser, parallel_tool_calls=body.parallel_tool_calls)
    if mode in ("required", "named"):
        try:
            validate_structured_outputs(request.structured_outputs(), "tools")
        except ValueError as error:
            raise OpenAIError(400, str(error), param="tools") from None
    return request


def check_tools(tools: list[dict[str, Any]]) -> None:
    """OpenAIError(400) naming the first tool field that is not a valid function tool."""
    if len(tools) > MAX_TOOLS:
        raise OpenAIError(400, f"tools has {len(tools)} entries, more than the {MAX_TOOLS} allowed",
                          param="tools")
    names: set[str] = set()
    for index, tool in enumerate(tools):
        field = f"tools[{index}]"
        if tool.get("type", "function") != "function":
            raise OpenAIError(400, f"{field}.type={tool.get('type')!r} is not supported: only 'function' tools are",
                              param=f"{field}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise OpenAIError(400, f"{field}.function is missing: a tool is {{'type': 'function', 'function': "
                                   "{'name': ..., 'parameters': {...}}}", param=f"{field}.function")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise OpenAIError(400, f"{field}.function.name={name!r} must be 1 to 64 letters, digits, '_' or '-'",
                              param=f"{field}.function.name")
        if name in names:
            raise OpenAIError(400, f"{field}.function.name={name!r} is given twice: tool names must be unique",
                              param=f"{field}.function.name")
        names.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise OpenAIError(400, f"{field}.function.description must be a string",
                              param=f"{field}.function.description")
        parameters = function.get("parameters")
        if parameters is None:
            continue
        parameters_field = f"{field}.function.parameters"
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise OpenAIError(400, f"{parameters_field} must be a JSON schema of type 'object'",
                              param=parameters_field)
        try:
            validate_structured_outputs(StructuredOutputsParams(json=parameters), parameters_field)
        except ValueError as error:
            raise OpenAIError(400, str(error), param=parameters_field) from None
