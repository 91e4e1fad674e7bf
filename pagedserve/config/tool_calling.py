"""ToolCallingConfig: how the OpenAI server finds tool calls in chat answers (server/tool_calling.py).

Server-side only: the engine never sees it (tool_choice "required" and named functions reach the engine as
structured outputs).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCallingConfig:
    # tool_choice "auto" (the default when a request has tools): the model decides, the parser finds its calls.
    enable_auto_tool_choice: bool = False
    # The model's call format (pagedserve/tool_parsers/): hermes, llama3_json, qwen3, deepseek_v3, ...
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            from pagedserve.tool_parsers.tool_parser_registry import TOOL_PARSERS

            if self.tool_call_parser not in TOOL_PARSERS:
                raise ValueError(f"tool_call_parser={self.tool_call_parser!r} must be one of {sorted(TOOL_PARSERS)} "
                                 "(or None)")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice=True needs a tool_call_parser (--tool-call-parser NAME): "
                             "without one no call can be found in the output")


__all__ = ["ToolCallingConfig"]
