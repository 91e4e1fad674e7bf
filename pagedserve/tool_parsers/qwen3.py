"""qwen3: Qwen3's tool calls, as its chat template teaches them (the hermes format):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

vLLM serves these Qwen3 models with `--tool-call-parser hermes`; its `qwen3_coder` / `qwen3_xml` parsers are for
Qwen3-Coder's XML calls (`<function=...><parameter=...>`, qwen3_coder.py here). With a reasoning parser, the
thinking is split off first, so a `<tool_call>` inside `<think>` is never a call.
"""
from __future__ import annotations

from pagedserve.tool_parsers.hermes import HermesToolParser


class Qwen3ToolParser(HermesToolParser):
    pass
