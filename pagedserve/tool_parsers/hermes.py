"""hermes: Hermes-2-Pro's format (also Qwen2.5's and Qwen3's), one JSON object per call between tags:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the blocks is content. A block that is not exactly one such object makes the output malformed. The
last block may lack its end tag when generation stopped right after the object.
"""
from __future__ import annotations

import json

from pagedserve.tool_parsers.partial_json import MalformedJSON, scan_call_object, skip_whitespace
from pagedserve.tool_parsers.tagged_blocks import TaggedCallsToolParser
from pagedserve.tool_parsers.tool_parser import ToolCallText


class HermesToolParser(TaggedCallsToolParser):
    malformed_errors = (MalformedJSON,)

    def parse_block(self, block: str, is_complete: bool) -> ToolCallText | None:
        return parse_call_block(block, is_complete)


def parse_call_block(block: str, is_complete: bool, arguments_keys: tuple[str, ...] = ("arguments",)) -> \
        ToolCallText | None:
    """The call in one block's text: None while its name is unknown. Raises MalformedJSON when the block is not
    (the beginning of) one call object, or, for a complete block, not exactly one valid call object."""
    object_scan = scan_call_object(block, 0, arguments_keys=arguments_keys)
    arguments = object_scan.arguments_text(block)
    if is_complete:
        if object_scan.end is None or object_scan.name is None or block[skip_whitespace(block, object_scan.end):]:
            raise MalformedJSON("a tool call block must hold exactly one complete call object")
        start = skip_whitespace(block, 0)
        try:
            json.loads(block[start:object_scan.end])
        except json.JSONDecodeError as error:
            raise MalformedJSON(str(error)) from None
        return ToolCallText(object_scan.name, arguments if arguments is not None else "{}")
    if object_scan.name is None or arguments is None:
        return None
    return ToolCallText(object_scan.name, arguments)
