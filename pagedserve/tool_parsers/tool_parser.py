"""ToolParser: the tool calls in a model's output, whole (`extract_tool_calls`) and streamed
(`extract_tool_calls_streaming`), with vLLM's method names.

A parser implements one function, `scan(text, is_final)`: the content and the calls that `text` makes certain.
Everything else is shared, so the streamed deltas of an output always concatenate to its non-streamed answer:
- a call's `arguments` are the JSON text the model wrote (checked to parse), so argument fragments are slices of
  the output and need no re-serialisation;
- a stream sends what each scan adds to the previous one: new content, a new call (id, type, name and the
  arguments so far), more arguments;
- an output that holds no call, or a call that does not parse (malformed), is content, all of it, verbatim.

One instance serves one output (the stream keeps its state on it), like vLLM's per-request parsers.
"""
from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.server.protocol import (DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall)


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCallText:
    """One call as the output spells it: the function's name and its arguments' JSON text (a prefix of it while
    the call is still arriving)."""

    name: str
    arguments: str


@dataclass
class ToolCallScan:
    """What a text makes certain: the content outside calls and the calls (the last may be partial when the
    text is not final). `is_malformed`: a call that can never parse, so the whole output is content."""

    content: str = ""
    calls: list[ToolCallText] = field(default_factory=list)
    is_malformed: bool = False


@dataclass
class ExtractedToolCallInformation:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None = None


@dataclass
class _SentCall:
    id: str
    name: str
    num_arguments_sent: int = 0


class ToolParser(ABC):
    """Finds tool calls in one output. Subclasses implement `scan`."""

    # True for formats whose markers are special tokens: the server then detokenizes them (as vLLM's parsers
    # ask through adjust_request), else the markers would never reach the text.
    needs_special_tokens: bool = False

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        self.model_tokenizer = tokenizer
        # The request's tools: formats that write values as text type them by the tool's schema.
        self.tools = tools
        self._num_content_sent = 0
        self._sent_calls: list[_SentCall] = []

    @abstractmethod
    def scan(self, text: str, is_final: bool) -> ToolCallScan:
        """The content and calls in `text`. When not final, leave out what more text could still change (a tail
        that may be the start of a tag, a name not yet closed); when final, a call that does not parse sets
        `is_malformed`."""

    def final_scan(self, text: str) -> ToolCallScan:
        """The scan of a finished output: malformed or without calls, all of it is content."""
        scan = self.scan(text, is_final=True)
        if scan.is_malformed or not scan.calls:
            return ToolCallScan(content=text)
        return scan

    def extract_tool_calls(self, model_output: str, request: Any = None) -> ExtractedToolCallInformation:
        """The calls and content of a whole output."""
        scan = self.final_scan(model_output)
        calls = [ToolCall(id=new_tool_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))
                 for call in scan.calls]
        return ExtractedToolCallInformation(tools_called=bool(calls), tool_calls=calls, content=scan.content or None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int] = (), current_token_ids: Sequence[int] = (),
                                     delta_token_ids: Sequence[int] = (), request: Any = None,
                                     is_final: bool = False) -> DeltaMessage | None:
        """What `current_text` (the output so far) adds to the deltas sent before; None when nothing is certain
        yet. `is_final` on the output's last delta flushes everything held back."""
        scan = self.final_scan(current_text) if is_final else self.scan(current_text, is_final=False)
        if scan.is_malformed or not self._extends_sent(scan):
            # A call already sent turned out malformed: what was sent stands, nothing else can follow it.
            return None
        content = scan.content[self._num_content_sent:]
        self._num_content_sent = len(scan.content)
        tool_calls = []
        for index, call in enumerate(scan.calls):
            if index == len(self._sent_calls):
                sent = _SentCall(id=new_tool_call_id(), name=call.name)
                self._sent_calls.append(sent)
                tool_calls.append(DeltaToolCall(index=index, id=sent.id, type="function", function=DeltaFunctionCall(
                    name=call.name, arguments=call.arguments)))
            else:
                sent = self._sent_calls[index]
                fragment = call.arguments[sent.num_arguments_sent:]
                if not fragment:
                    continue
                tool_calls.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment)))
            sent.num_arguments_sent = len(call.arguments)
        if not content and not tool_calls:
            return None
        return DeltaMessage(content=content or None, tool_calls=tool_calls or None)

    @property
    def num_calls_sent(self) -> int:
        return len(self._sent_calls)

    def _extends_sent(self, scan: ToolCallScan) -> bool:
        """Whether `scan` only adds to what was sent (the same content and calls, longer)."""
        if len(scan.content) < self._num_content_sent or len(scan.calls) < len(self._sent_calls):
            return False
        return all(call.name == sent.name and len(call.arguments) >= sent.num_arguments_sent
                   for call, sent in zip(scan.calls, self._sent_calls))
