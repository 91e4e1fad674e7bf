"""A chat choice's answer read from the model's text: the reasoning split off first (--reasoning-parser), then
the tool calls found in the content that follows (pagedserve/tool_parsers/).

`parse_answer` reads a whole output, `AnswerStream` the same output delta by delta; both use the same parsers,
so a stream's deltas concatenate to the whole answer: reasoning first, then content and tool calls.
"""
from __future__ import annotations

from pagedserve.reasoning.reasoning_parser import ReasoningParser, ReasoningStream
from pagedserve.server.protocol import ChatResponseMessage, DeltaMessage
from pagedserve.tool_parsers.tool_parser import ToolParser


def parse_answer(text: str, reasoning_parser: ReasoningParser | None,
                 tool_parser: ToolParser | None) -> ChatResponseMessage:
    reasoning: str | None = None
    content: str | None = text
    if reasoning_parser is not None:
        reasoning, content = reasoning_parser.split(text)
    if tool_parser is None:
        return ChatResponseMessage(content=content, reasoning_content=reasoning)
    extracted = tool_parser.extract_tool_calls(content or "")
    return ChatResponseMessage(content=extracted.content, reasoning_content=reasoning,
                               tool_calls=extracted.tool_calls or None)


class AnswerStream:
    """One streamed choice: `feed` each text delta of the output, get the answer's delta."""

    def __init__(self, reasoning_parser: ReasoningParser | None, tool_parser: ToolParser | None) -> None:
        self.reasoning_stream = ReasoningStream(reasoning_parser) if reasoning_parser is not None else None
        self.tool_parser = tool_parser
        self.content = ""  # the content so far, which the tool parser reads

    @property
    def called_tools(self) -> bool:
        return self.tool_parser is not None and self.tool_parser.num_calls_sent > 0

    def feed(self, text: str, is_final: bool) -> DeltaMessage:
        """The delta `text` makes certain (every field None: nothing yet, e.g. a tag still arriving)."""
        reasoning, content = None, text
        if self.reasoning_stream is not None:
            reasoning, content = self.reasoning_stream.feed(text, is_final)
        if self.tool_parser is None:
            return DeltaMessage(content=content or None, reasoning_content=reasoning or None)
        previous = self.content
        self.content += content
        found = self.tool_parser.extract_tool_calls_streaming(previous, self.content, content, is_final=is_final)
        return DeltaMessage(content=found.content if found else None, reasoning_content=reasoning or None,
                            tool_calls=found.tool_calls if found else None)
