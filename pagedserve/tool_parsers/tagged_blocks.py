"""Split an output into content gaps and tagged blocks (`<tool_call>...</tool_call>`), as far as it is certain.

The rule for content, shared by every tagged format: the text between blocks is content unless it is only
whitespace (the separators models put around calls). While the output grows, a gap that is whitespace so far
and a tail that may be the start of a tag are held back; both are decided by the text that follows.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

from pagedserve.tool_parsers.tool_parser import ToolCallScan, ToolCallText, ToolParser


@dataclass
class TaggedText:
    # The kept gaps, joined.
    content: str
    # The text inside each block; the last one is open (no end tag yet) when `is_last_open`.
    blocks: list[str]
    is_last_open: bool = False


def partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest proper prefix of `tag` that `text` ends with."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def kept_gap(gap: str, is_final_gap: bool, start_tag: str) -> str:
    """The part of a gap that is certainly content; the last gap of a growing output keeps back a tail that may
    start `start_tag`."""
    if not is_final_gap:
        gap = gap[:len(gap) - partial_tag_length(gap, start_tag)]
    return gap if gap.strip() else ""


def split_tagged(text: str, start_tag: str, end_tag: str, is_final: bool) -> TaggedText:
    """The gaps and blocks of `text`. A final text's open block (no end tag) is still a block: its parser decides
    whether it is a whole call."""
    content: list[str] = []
    blocks: list[str] = []
    position = 0
    while True:
        start = text.find(start_tag, position)
        if start < 0:
            content.append(kept_gap(text[position:], is_final, start_tag))
            return TaggedText("".join(content), blocks)
        content.append(kept_gap(text[position:start], True, start_tag))
        body_start = start + len(start_tag)
        end = text.find(end_tag, body_start)
        if end < 0:
            blocks.append(text[body_start:])
            return TaggedText("".join(content), blocks, is_last_open=True)
        blocks.append(text[body_start:end])
        position = end + len(end_tag)


class TaggedCallsToolParser(ToolParser):
    """A format whose calls sit one per `start_tag` ... `end_tag` block; subclasses parse one block."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"
    # What parse_block raises for a block that can never be a call (the whole output is then malformed).
    malformed_errors: tuple[type[Exception], ...] = (ValueError,)

    @abstractmethod
    def parse_block(self, block: str, is_complete: bool) -> ToolCallText | None:
        """The call in one block; None while it is still arriving."""

    def scan(self, text: str, is_final: bool) -> ToolCallScan:
        tagged = split_tagged(text, self.start_tag, self.end_tag, is_final)
        scan = ToolCallScan(content=tagged.content)
        for index, block in enumerate(tagged.blocks):
            is_open = tagged.is_last_open and index == len(tagged.blocks) - 1
            try:
                call = self.parse_block(block, is_complete=is_final or not is_open)
            except self.malformed_errors:
                scan.is_malformed = True
                return scan
            if call is None:
                break  # still arriving
            scan.calls.append(call)
        return scan
