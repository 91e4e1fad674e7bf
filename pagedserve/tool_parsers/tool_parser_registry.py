"""The tool call parsers by name (`--tool-call-parser`), vLLM's names where vLLM has the format."""
from __future__ import annotations

from typing import Any

from pagedserve.tool_parsers.deepseek_v3 import DeepSeekV31ToolParser, DeepSeekV3ToolParser
from pagedserve.tool_parsers.hermes import HermesToolParser
from pagedserve.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedserve.tool_parsers.qwen3 import Qwen3ToolParser
from pagedserve.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from pagedserve.tool_parsers.tool_parser import ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    # Llama 4 writes the same JSON calls.
    "llama4_json": Llama3JsonToolParser,
    "qwen3": Qwen3ToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV31ToolParser,
    "deepseek": DeepSeekV3ToolParser,
}


def get_tool_parser(name: str, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> ToolParser:
    """A new parser (one per output: it keeps the stream's state) of the format `name`, for a request's tools."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser={name!r} must be one of {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name](tokenizer, tools)
