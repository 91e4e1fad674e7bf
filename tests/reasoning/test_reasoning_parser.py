"""Reasoning parsers on fixtures: the whole split, the streamed split (every way of cutting the text into deltas
gives the same parts), and the end of reasoning in token ids (what structured outputs wait for)."""
from __future__ import annotations

import pytest

from pagedserve.reasoning.reasoning_parser import ReasoningStream, get_reasoning_parser

# (parser, output text, reasoning_content, content)
FIXTURES = [
    ("qwen3", "<think>2 and 2 make 4.</think>The answer is 4.", "2 and 2 make 4.", "The answer is 4."),
    ("qwen3", "<think>\nhmm\n</think>\n\n{\"a\": 1}", "\nhmm\n", "\n\n{\"a\": 1}"),
    ("qwen3", "The answer is 4.", None, "The answer is 4."),  # no thinking: all content
    ("qwen3", "<think>still thinking when cut", "still thinking when cut", None),
    ("qwen3", "<think></think>Direct.", None, "Direct."),
    ("qwen3", "4 < 5 and </think> in text", None, "4 < 5 and </think> in text"),  # no leading tag: content
    ("deepseek_r1", "2 and 2 make 4.</think>The answer is 4.", "2 and 2 make 4.", "The answer is 4."),
    ("deepseek_r1", "<think>2 and 2.</think>4", "2 and 2.", "4"),
    ("deepseek_r1", "still thinking when cut", "still thinking when cut", None),
    ("deepseek_r1", "a </thin b</think>c</think>d", "a </thin b", "c</think>d"),
    ("deepseek_r1", "</think>", None, None),
]


@pytest.mark.parametrize("name, text, reasoning, content", FIXTURES)
def test_split(name, text, reasoning, content):
    assert get_reasoning_parser(name).split(text) == (reasoning, content)


@pytest.mark.parametrize("name, text, reasoning, content", FIXTURES)
def test_streamed_deltas_concatenate_to_the_split_whatever_the_cuts(name, text, reasoning, content):
    parser = get_reasoning_parser(name)
    for step in (1, 2, 3, 5, 7, len(text) or 1):
        stream = ReasoningStream(parser)
        pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
        parts = [stream.feed(piece, is_final=index == len(pieces) - 1) for index, piece in enumerate(pieces)]
        streamed_reasoning = "".join(r for r, _ in parts)
        streamed_content = "".join(c for _, c in parts)
        assert (streamed_reasoning or None, streamed_content or None) == (reasoning, content), step


def test_reasoning_end_in_the_prompt_and_in_the_output():
    parser = get_reasoning_parser("qwen3")
    assert parser.is_reasoning_ended_in_prompt("user<think>\n\n</think>\n\n")
    assert not parser.is_reasoning_ended_in_prompt("a</think>b<think>")
    assert not parser.is_reasoning_ended_in_prompt("no tags")
    assert parser.ends_reasoning("so it is 4.</think>") and not parser.ends_reasoning("so it is 4.</thin")


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("r2")
