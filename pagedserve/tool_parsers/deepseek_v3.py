"""deepseek_v3 and deepseek_v31: DeepSeek's tool calls, each between special tokens inside one calls section.

    V3:   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
          ```json
          {"city": "Paris"}
          ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>
          <｜tool▁calls▁end｜>

Text before the section (and after it) is content; the arguments must be one JSON object. The server's
`deepseek` name is V3's format. The markers are special tokens, so the server keeps them in the text.
"""
from __future__ import annotations

import json

from pagedserve.tool_parsers.tagged_blocks import partial_tag_length, split_tagged
from pagedserve.tool_parsers.tool_parser import ToolCallScan, ToolCallText, ToolParser

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEPARATOR = "<｜tool▁sep｜>"
ARGUMENTS_OPEN = "\n```json\n"
ARGUMENTS_CLOSE = "\n```"


class DeepSeekV3ToolParser(ToolParser):
    needs_special_tokens = True
    # V3 writes 'function<sep>name\n```json\n{...}\n```'; V3.1 writes 'name<sep>{...}'.
    is_fenced = True

    def scan(self, text: str, is_final: bool) -> ToolCallScan:
        sections = split_tagged(text, CALLS_BEGIN, CALLS_END, is_final)
        scan = ToolCallScan(content=sections.content)
        for section_index, section in enumerate(sections.blocks):
            is_open_section = sections.is_last_open and section_index == len(sections.blocks) - 1
            calls = split_tagged(section, CALL_BEGIN, CALL_END, is_final or not is_open_section)
            if calls.content:
                scan.is_malformed = True  # text between calls inside the section
                return scan
            for call_index, body in enumerate(calls.blocks):
                is_open = calls.is_last_open and call_index == len(calls.blocks) - 1
                call = self._parse_call(body, is_complete=is_final or not is_open)
                if call is None:
                    if is_final or not is_open:
                        scan.is_malformed = True
                    return scan
                scan.calls.append(call)
        return scan

    def _parse_call(self, body: str, is_complete: bool) -> ToolCallText | None:
        """The call in one block; None while its name is unknown, or (complete) when it does not parse."""
        head, separator, rest = body.partition(SEPARATOR)
        if not separator:
            return None
        if self.is_fenced:
            if head != "function":
                return None
            name, newline, arguments = rest.partition("\n")
            fence = ARGUMENTS_OPEN[1:]
            if not newline or not arguments.startswith(fence):
                return None  # the name or the fence is arriving (or, in a complete call, missing)
            arguments = arguments[len(fence):]
            if is_complete:
                if not arguments.endswith(ARGUMENTS_CLOSE):
                    return None
                arguments = arguments[:-len(ARGUMENTS_CLOSE)]
            else:
                end = arguments.find(ARGUMENTS_CLOSE)
                arguments = arguments[:end] if end >= 0 else \
                    arguments[:len(arguments) - partial_tag_length(arguments, ARGUMENTS_CLOSE)]
        else:
            name, arguments = head, rest
            if not is_complete:
                arguments = arguments[:len(arguments) - partial_tag_length(arguments, CALL_END)]
        name = name.strip()
        if not name:
            return None
        if is_complete:
            arguments = arguments.strip()
            try:
                if not isinstance(json.loads(arguments), dict):
                    return None
            except json.JSONDecodeError:
                return None
            return ToolCallText(name, arguments)
        # Surrounding whitespace is not part of the arguments: hold back what may still be trailing.
        arguments = arguments.lstrip()
        return ToolCallText(name, arguments[:len(arguments.rstrip())])


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    is_fenced = False
