"""ReasoningParser: where a reasoning model's thinking ends, in text and in token ids.

Both parsers read the thinking between `<think>` and `</think>`:
- qwen3: the output reasons only when it starts with `<think>`; without it, all of it is content.
- deepseek_r1: the chat template opens `<think>` in the prompt, so the output reasons from its first token (a
  leading `<think>` is skipped).
In both, reasoning runs until `</think>` (or the end of the output) and the rest is content. `split` and
`ReasoningStream` implement the same function, whole and incrementally, so streamed deltas concatenate to the
non-streamed answer.
"""
from __future__ import annotations

from dataclasses import dataclass

START_TAG = "<think>"
END_TAG = "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    # True: reasoning starts with the output (the prompt opened it); False: only after a leading start tag.
    starts_in_reasoning: bool

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; None for an empty part."""
        reasoning, content = self._split(text, is_final=True)
        return reasoning or None, content or None

    def _split(self, text: str, is_final: bool) -> tuple[str, str]:
        """The split of `text`; when not final, a tail that may still grow into a tag is left out of both."""
        if text.startswith(START_TAG):
            body = text[len(START_TAG):]
        elif not is_final and START_TAG.startswith(text):
            return "", ""  # a start tag may be arriving
        elif self.starts_in_reasoning:
            body = text
        else:
            return "", text
        end = body.find(END_TAG)
        if end >= 0:
            return body[:end], body[end + len(END_TAG):]
        if not is_final:
            body = body[:len(body) - _partial_tag_length(body, END_TAG)]
        return body, ""

    @staticmethod
    def is_reasoning_ended_in_prompt(prompt_text: str) -> bool:
        """Whether the prompt already closed the reasoning (an end tag after its last start tag, e.g. a template
        with thinking disabled): then structured outputs apply from the first output token."""
        end = prompt_text.rfind(END_TAG)
        return end >= 0 and end > prompt_text.rfind(START_TAG)

    @staticmethod
    def ends_reasoning(output_tail: str) -> bool:
        """Whether generated text (the tail of the output so far) holds the end tag. Matched on text, not token
        ids: a tokenizer without the tag as one token spells it in several ways."""
        return END_TAG in output_tail


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest proper prefix of `tag` that `text` ends with."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class ReasoningStream:
    """Incremental split of one streamed output: `feed` each text delta, `finish` at the end."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self._num_reasoning = 0
        self._num_content = 0

    def feed(self, delta: str, is_final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta) the new text makes certain."""
        self.text += delta
        reasoning, content = self.parser._split(self.text, is_final)
        reasoning_delta = reasoning[self._num_reasoning:]
        content_delta = content[self._num_content:]
        self._num_reasoning = max(self._num_reasoning, len(reasoning))
        self._num_content = max(self._num_content, len(content))
        return reasoning_delta, content_delta


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3", starts_in_reasoning=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_in_reasoning=True),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={name!r} must be one of {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]
