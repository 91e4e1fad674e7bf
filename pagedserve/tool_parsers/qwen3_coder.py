"""qwen3_coder (also qwen3_xml, vLLM's names): Qwen3-Coder's XML tool calls.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    2
    </parameter>
    </function>
    </tool_call>

A value is text (one newline after the opening tag and one before the closing tag are layout, not value). It
becomes the JSON type its parameter's schema declares in the request's tools (integer, number, boolean, object,
array; "null" is null) and stays a string when the schema says string, says nothing, or the text does not
convert. A missing </parameter> ends the value at the next <parameter= or at </function> (as vLLM). The arguments
are the JSON object of these values, streamed one finished parameter at a time: '{', '"city": "Paris"',
', "days": 2', '}'.
"""
from __future__ import annotations

import json
from typing import Any

from pagedserve.tool_parsers.partial_json import skip_whitespace
from pagedserve.tool_parsers.tagged_blocks import TaggedCallsToolParser
from pagedserve.tool_parsers.tool_parser import ToolCallText

FUNCTION_PREFIX = "<function="
FUNCTION_END = "</function>"
PARAMETER_PREFIX = "<parameter="
PARAMETER_END = "</parameter>"


class MalformedCall(ValueError):
    """A block that can never be a call."""


class Qwen3CoderToolParser(TaggedCallsToolParser):
    malformed_errors = (MalformedCall,)

    def parse_block(self, block: str, is_complete: bool) -> ToolCallText | None:
        """The call in one block, with the parameters finished so far; None while its name is unknown."""
        position = skip_whitespace(block, 0)
        if not block.startswith(FUNCTION_PREFIX, position):
            if not is_complete and FUNCTION_PREFIX.startswith(block[position:]):
                return None
            raise MalformedCall("a block must start with <function=")
        name_start = position + len(FUNCTION_PREFIX)
        name_end = block.find(">", name_start)
        if name_end < 0:
            if is_complete:
                raise MalformedCall("<function= is not closed")
            return None
        name = block[name_start:name_end].strip()
        if not name:
            raise MalformedCall("the function has no name")
        body_end = block.find(FUNCTION_END, name_end)
        if body_end >= 0 and block[body_end + len(FUNCTION_END):].strip():
            raise MalformedCall("text after </function>")
        is_closed = body_end >= 0 or is_complete
        body = block[name_end + 1:body_end if body_end >= 0 else len(block)]
        items = []
        position = 0
        has_parameter = False
        while True:
            start = body.find(PARAMETER_PREFIX, position)
            gap = body[position:start if start >= 0 else len(body)].strip()
            if gap and (start >= 0 or is_closed or not _may_become_a_tag(gap)):
                raise MalformedCall("text between parameters")
            if start < 0:
                break
            has_parameter = True
            key_start = start + len(PARAMETER_PREFIX)
            key_end = body.find(">", key_start)
            if key_end < 0:
                if is_closed:
                    raise MalformedCall("<parameter= is not closed")
                break
            value_start = key_end + 1
            end = body.find(PARAMETER_END, value_start)
            next_start = body.find(PARAMETER_PREFIX, value_start)
            if end >= 0 and (next_start < 0 or end < next_start):
                value_end, position = end, end + len(PARAMETER_END)
            elif next_start >= 0 or is_closed:
                value_end = position = next_start if next_start >= 0 else len(body)
            else:
                break  # the value is still arriving
            key = body[key_start:key_end].strip()
            value = self._typed_value(name, key, _strip_layout(body[value_start:value_end]))
            items.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
        if not (has_parameter or is_closed):
            return None  # the call goes out once its body is certainly parameters (text there is malformed)
        return ToolCallText(name, "{" + ", ".join(items) + ("}" if is_closed else ""))

    def _typed_value(self, function_name: str, key: str, text: str) -> Any:
        """`text` as the JSON type the tool's schema gives the parameter; the text itself when it does not fit."""
        if text.strip().lower() == "null":
            return None
        declared = self._parameter_type(function_name, key)
        try:
            if declared in ("integer", "number"):
                value = json.loads(text.strip())
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    return value
            elif declared == "boolean" and text.strip().lower() in ("true", "false"):
                return text.strip().lower() == "true"
            elif declared in ("object", "array"):
                value = json.loads(text)
                if isinstance(value, dict if declared == "object" else list):
                    return value
        except json.JSONDecodeError:
            pass
        return text

    def _parameter_type(self, function_name: str, key: str) -> str | None:
        for tool in self.tools or []:
            function = tool.get("function") or {}
            if function.get("name") == function_name:
                schema = ((function.get("parameters") or {}).get("properties") or {}).get(key) or {}
                declared = schema.get("type")
                if isinstance(declared, list):
                    declared = next((kind for kind in declared if kind != "null"), None)
                return declared if isinstance(declared, str) else None
        return None


def _may_become_a_tag(text: str) -> bool:
    return PARAMETER_PREFIX.startswith(text) or FUNCTION_END.startswith(text)


def _strip_layout(value: str) -> str:
    """The value without the newline after its opening tag and the one before its closing tag."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value
