"""Tool calls a grammar forces: tool_choice "required" or a named function.

The request's output is constrained by a JSON schema built from the tools (through structured outputs), so the
arguments always parse against the tool's parameters schema, and the calls come from that JSON, not from a
model-specific format:
- a named function: the output is its arguments object;
- "required": the output is an array of at least one `{"name": ..., "parameters": {...}}`, each item one of the
  tools (vLLM's shape); at most one item when parallel_tool_calls is false.
The parsers below read these outputs with the shared ToolParser machinery, so they stream like the formats do.
"""
from __future__ import annotations

import json
from typing import Any

from pagedserve.tool_parsers.partial_json import MalformedJSON, scan_call_object, skip_whitespace
from pagedserve.tool_parsers.tool_parser import ToolCallScan, ToolCallText, ToolParser

# A function declared without parameters takes none.
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def function_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or EMPTY_PARAMETERS


def named_function_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return function_parameters(tool)


def required_tool_calls_schema(tools: list[dict[str, Any]], parallel_tool_calls: bool = True) -> dict[str, Any]:
    """An array of calls to any of `tools`. Each tool's `$defs` move to the top, where its `#/$defs/...`
    references point once the schema is nested; two tools defining one name differently is a ValueError."""
    definitions: dict[str, Any] = {}
    alternatives = []
    for index, tool in enumerate(tools):
        parameters = dict(function_parameters(tool))
        for key in ("$defs", "definitions"):
            for name, definition in (parameters.pop(key, None) or {}).items():
                if definitions.setdefault(name, definition) != definition:
                    raise ValueError(f"tools[{index}].function.parameters: the definition {name!r} differs from "
                                     "another tool's of the same name; tool_choice 'required' needs them equal")
        alternatives.append({"type": "object",
                             "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                            "parameters": parameters},
                             "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


class NamedFunctionParser(ToolParser):
    """The output is the named function's arguments object: one call, its arguments the whole output."""

    def __init__(self, function_name: str, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self.function_name = function_name

    def scan(self, text: str, is_final: bool) -> ToolCallScan:
        arguments = text.strip() if is_final else text.lstrip()
        if not is_final:
            arguments = arguments[:len(arguments.rstrip())]  # trailing whitespace may end the output
        elif not arguments:
            return ToolCallScan(is_malformed=True)
        return ToolCallScan(calls=[ToolCallText(self.function_name, arguments)])

    def final_scan(self, text: str) -> ToolCallScan:
        # A cut-off object (finish_reason "length") is still the call asked for: its arguments are what came.
        return self.scan(text, is_final=True)


class RequiredToolCallsParser(ToolParser):
    """The output is a JSON array of `{"name": ..., "parameters": {...}}` calls."""

    def scan(self, text: str, is_final: bool) -> ToolCallScan:
        scan = ToolCallScan()
        position = skip_whitespace(text, 0)
        try:
            if position >= len(text):
                raise MalformedJSON("no calls") if is_final else _Incomplete
            if text[position] != "[":
                raise MalformedJSON("the calls must be a JSON array")
            position += 1
            while True:
                position = skip_whitespace(text, position)
                if position >= len(text):
                    raise _Incomplete
                if text[position] == "]" and not scan.calls:
                    raise MalformedJSON("no calls")
                object_scan = scan_call_object(text, position, arguments_keys=("parameters",))
                arguments = object_scan.arguments_text(text)
                if object_scan.name is not None and arguments is not None:
                    scan.calls.append(ToolCallText(object_scan.name, arguments))
                if object_scan.end is None:
                    raise _Incomplete
                if object_scan.name is None or arguments is None:
                    raise MalformedJSON("a call needs a name and parameters")
                position = skip_whitespace(text, object_scan.end)
                if position >= len(text):
                    raise _Incomplete
                if text[position] == "]":
                    if is_final:
                        json.loads(text)
                    return scan
                if text[position] != ",":
                    raise MalformedJSON(f"expected ',' or ']', found {text[position]!r}")
                position += 1
        except _Incomplete:
            if is_final:
                scan.is_malformed = True
            return scan
        except (MalformedJSON, json.JSONDecodeError):
            scan.is_malformed = True
            return scan

    def final_scan(self, text: str) -> ToolCallScan:
        scan = self.scan(text, is_final=True)
        if scan.is_malformed and scan.calls:
            # Cut off (finish_reason "length"): the calls that came stay calls, as they streamed.
            return ToolCallScan(calls=scan.calls)
        return super().final_scan(text)


class _Incomplete(Exception):
    """The text ends before the array does."""
