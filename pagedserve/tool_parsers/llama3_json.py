"""llama3_json: Llama 3.1/3.2's JSON tool calls. The whole output is the calls, after an optional
`<|python_tag|>`: JSON objects with "name" and "parameters" (or "arguments"), separated by ';':

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

An output that does not start with '{' (after the tag and whitespace) is content; one that starts like a call
but is not a ';'-separated list of call objects is malformed (content too).
"""
from __future__ import annotations

import json

from pagedserve.tool_parsers.partial_json import MalformedJSON, scan_call_object, skip_whitespace
from pagedserve.tool_parsers.tool_parser import ToolCallScan, ToolCallText, ToolParser

PYTHON_TAG = "<|python_tag|>"
ARGUMENTS_KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolParser):
    # <|python_tag|> is a special token of Llama 3's tokenizer.
    needs_special_tokens = True

    def scan(self, text: str, is_final: bool) -> ToolCallScan:
        position = skip_whitespace(text, 0)
        if text.startswith(PYTHON_TAG, position):
            position = skip_whitespace(text, position + len(PYTHON_TAG))
        elif not is_final and PYTHON_TAG.startswith(text[position:]):
            return ToolCallScan()  # the tag may be arriving
        if position >= len(text):
            return ToolCallScan(content=text if is_final else "")
        if text[position] != "{":
            return ToolCallScan(content=text if is_final or not text[position:].startswith("<") else "")
        scan = ToolCallScan()
        try:
            while True:
                object_scan = scan_call_object(text, position, arguments_keys=ARGUMENTS_KEYS)
                arguments = object_scan.arguments_text(text)
                if object_scan.end is None:
                    if is_final:
                        raise MalformedJSON("the output ends inside a call object")
                    if object_scan.name is not None and arguments is not None:
                        scan.calls.append(ToolCallText(object_scan.name, arguments))
                    return scan
                if object_scan.name is None:
                    raise MalformedJSON("a call object has no name")
                json.loads(text[skip_whitespace(text, position):object_scan.end])
                scan.calls.append(ToolCallText(object_scan.name, arguments if arguments is not None else "{}"))
                position = skip_whitespace(text, object_scan.end)
                if position >= len(text):
                    return scan
                if text[position] != ";":
                    raise MalformedJSON(f"calls must be separated by ';', found {text[position]!r}")
                position += 1
        except (MalformedJSON, json.JSONDecodeError):
            scan.is_malformed = True
            return scan
