"""Each tool call parser on recorded model outputs: the calls and content found whole, the same found when the
output streams in pieces of any size, and malformed outputs returned as content (never an exception)."""
from __future__ import annotations

import json

import pytest

from recorded_outputs import MALFORMED, MALFORMED_AFTER_A_CALL_STREAMED, REQUIRED, TIME, TOOLS, WELL_FORMED

from pagedserve.reasoning.reasoning_parser import get_reasoning_parser
from pagedserve.server.chat_answer import AnswerStream, parse_answer
from pagedserve.tool_parsers.constrained_tool_calls import NamedFunctionParser, RequiredToolCallsParser
from pagedserve.tool_parsers.tool_parser import ToolParser
from pagedserve.tool_parsers.tool_parser_registry import TOOL_PARSERS
from pagedserve.tool_parsers.tool_parser_registry import get_tool_parser as get_parser

PIECE_SIZES = (1, 2, 3, 5, 8, 10_000)


def get_tool_parser(name: str) -> ToolParser:
    return get_parser(name, tools=TOOLS)


def whole_answer(parser: ToolParser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    extracted = parser.extract_tool_calls(text)
    assert extracted.tools_called == bool(extracted.tool_calls)
    for call in extracted.tool_calls:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    return extracted.content, [(call.function.name, call.function.arguments) for call in extracted.tool_calls]


def streamed_answer(parser: ToolParser, text: str, size: int) -> tuple[str | None, list[tuple[str, str]]]:
    """Feed `text` in pieces of `size` characters; reassemble the deltas as an OpenAI client does, checking that
    each call's first delta carries its id, type and name, and later ones only argument fragments."""
    content = ""
    calls: dict[int, list[str]] = {}
    previous = ""
    for end in range(size, len(text) + size, size):
        current = text[:end]
        delta = parser.extract_tool_calls_streaming(previous, current, current[len(previous):],
                                                    is_final=end >= len(text))
        previous = current
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index not in calls:
                assert call.index == len(calls) and call.id.startswith("chatcmpl-tool-") and call.type == "function"
                calls[call.index] = [call.function.name, ""]
            else:
                assert call.id is None and call.type is None and call.function.name is None
            calls[call.index][1] += call.function.arguments or ""
    return content or None, [(name, arguments) for name, arguments in calls.values()]


@pytest.mark.parametrize("case", sorted(WELL_FORMED))
def test_well_formed_outputs_whole_and_streamed(case):
    name, text, expected_calls, expected_content = WELL_FORMED[case]
    content, calls = whole_answer(get_tool_parser(name), text)
    assert [(call_name, json.loads(arguments)) for call_name, arguments in calls] == expected_calls
    assert content == expected_content
    for size in PIECE_SIZES:
        assert streamed_answer(get_tool_parser(name), text, size) == (content, calls), size


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_outputs_are_content_whole_and_streamed(case):
    name, text = MALFORMED[case]
    assert whole_answer(get_tool_parser(name), text) == (text, [])
    for size in PIECE_SIZES:
        assert streamed_answer(get_tool_parser(name), text, size) == (text, []), size


@pytest.mark.parametrize("case", sorted(MALFORMED_AFTER_A_CALL_STREAMED))
def test_malformed_after_a_streamed_call(case):
    name, text, sent_call = MALFORMED_AFTER_A_CALL_STREAMED[case]
    assert whole_answer(get_tool_parser(name), text) == (text, [])
    # Streamed in small pieces the call went out before the fault showed; in one piece nothing did.
    assert streamed_answer(get_tool_parser(name), text, 1) == (None, [sent_call])
    assert streamed_answer(get_tool_parser(name), text, len(text)) == (text, [])


def test_every_registered_parser_has_recorded_outputs():
    names = {case[0] for case in WELL_FORMED.values()} | {case[0] for case in MALFORMED.values()}
    assert set(TOOL_PARSERS) - names <= {"llama4_json"}
    with pytest.raises(ValueError, match="tool_call_parser='mistral' must be one of"):
        get_tool_parser("mistral")


@pytest.mark.parametrize("case", sorted(REQUIRED))
def test_required_tool_calls_whole_and_streamed(case):
    text, expected_calls = REQUIRED[case]
    content, calls = whole_answer(RequiredToolCallsParser(), text)
    assert content is None and [(name, json.loads(arguments)) for name, arguments in calls] == expected_calls
    for size in PIECE_SIZES:
        assert streamed_answer(RequiredToolCallsParser(), text, size) == (None, calls), size


def test_named_function_whole_and_streamed():
    text = '{"timezone": "Europe/Paris"}'
    assert whole_answer(NamedFunctionParser("get_time"), text) == (None, [("get_time", text)])
    for size in PIECE_SIZES:
        assert streamed_answer(NamedFunctionParser("get_time"), text, size) == (None, [("get_time", text)])


def test_a_cut_off_forced_call_keeps_what_came():
    """finish_reason 'length' inside a forced call: the call stays, with the arguments that came, both ways."""
    text = '[{"name": "get_time", "parameters": {"timezone": "Eur'
    assert whole_answer(RequiredToolCallsParser(), text) == (None, [("get_time", '{"timezone": "Eur')])
    assert streamed_answer(RequiredToolCallsParser(), text, 4) == (None, [("get_time", '{"timezone": "Eur')])


@pytest.mark.parametrize("reasoning_parser_name, prefix", [("qwen3", "<think>"), ("deepseek_r1", "")])
def test_reasoning_comes_first_then_the_tool_calls(reasoning_parser_name, prefix):
    reasoning_parser = get_reasoning_parser(reasoning_parser_name)
    text = (prefix + "The user wants the time.</think>Checking.<tool_call>\n"
            '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>')
    message = parse_answer(text, reasoning_parser, get_tool_parser("hermes"))
    assert message.reasoning_content == "The user wants the time." and message.content == "Checking."
    assert [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls] == [TIME]
    # A <tool_call> inside the reasoning is thinking, not a call.
    thinking = parse_answer(prefix + "maybe <tool_call>{}</tool_call>?</think>No call.", reasoning_parser,
                            get_tool_parser("hermes"))
    assert thinking.tool_calls is None and thinking.content == "No call."
    for size in (1, 4, 9):
        stream = AnswerStream(reasoning_parser, get_tool_parser("hermes"))
        kinds, reasoning, content, arguments = [], "", "", ""
        for start in range(0, len(text), size):
            delta = stream.feed(text[start:start + size], is_final=start + size >= len(text))
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
            arguments += "".join(call.function.arguments or "" for call in delta.tool_calls or [])
            kinds += [kind for kind in ("reasoning_content", "content", "tool_calls") if getattr(delta, kind)]
        assert (reasoning, content, arguments) == (message.reasoning_content, message.content,
                                                   message.tool_calls[0].function.arguments)
        assert kinds.index("content") > max(i for i, kind in enumerate(kinds) if kind == "reasoning_content")
        assert stream.called_tools
