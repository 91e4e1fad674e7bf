"""Where JSON values begin and end in text that may still be growing (a streamed model output).

Tool parsers hand out a call's arguments as the exact JSON text the model wrote, so a streamed call's argument
fragments concatenate to the non-streamed `arguments` string. That needs spans, not parsed values: these
scanners find them, and tell a value that is still arriving (None) from one that can no longer be JSON
(MalformedJSON). Whether a finished span is valid JSON is left to `json.loads`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\n\r"
# Characters of numbers, true, false and null: a scalar runs until the first other character.
_SCALAR_CHARACTERS = frozenset("+-.0123456789eEtruefalsn")


class MalformedJSON(ValueError):
    """The text cannot become the JSON expected, whatever follows."""


def skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in WHITESPACE:
        position += 1
    return position


def string_end(text: str, position: int) -> int | None:
    """The index after the string starting at `position` (a '"'); None while it is unterminated."""
    position += 1
    while position < len(text):
        character = text[position]
        if character == "\\":
            position += 2
            continue
        if character == '"':
            return position + 1
        position += 1
    return None


def value_end(text: str, position: int) -> int | None:
    """The index after the JSON value starting at `position`; None while it is incomplete."""
    if position >= len(text):
        return None
    character = text[position]
    if character == '"':
        return string_end(text, position)
    if character in "{[":
        depth = 0
        while position < len(text):
            character = text[position]
            if character == '"':
                end = string_end(text, position)
                if end is None:
                    return None
                position = end
                continue
            if character in "{[":
                depth += 1
            elif character in "}]":
                depth -= 1
                if depth == 0:
                    return position + 1
            position += 1
        return None
    if character not in _SCALAR_CHARACTERS:
        raise MalformedJSON(f"{character!r} cannot start a JSON value")
    while position < len(text) and text[position] in _SCALAR_CHARACTERS:
        position += 1
    # A scalar at the very end may still be growing (12 -> 123).
    return position if position < len(text) else None


@dataclass
class CallObjectScan:
    """What is known of a tool call object `{"name": ..., "arguments": {...}}` in possibly partial text."""

    name: str | None = None
    # The arguments object's text: [arguments_start, arguments_end); arguments_end is None while it is arriving.
    arguments_start: int | None = None
    arguments_end: int | None = None
    # The index after the call object's closing brace; None while it is arriving.
    end: int | None = None

    def arguments_text(self, text: str) -> str | None:
        """The arguments' text so far (all of it once complete); None before they start."""
        if self.arguments_start is None:
            return None
        return text[self.arguments_start:self.arguments_end]


def scan_call_object(text: str, start: int, name_key: str = "name",
                     arguments_keys: tuple[str, ...] = ("arguments",)) -> CallObjectScan:
    """Scan the call object starting at (whitespace before) `start`, as far as `text` goes.

    Raises MalformedJSON when the text is not (the beginning of) an object whose `name_key` is a string and whose
    arguments (the first of `arguments_keys` present) are an object. Other keys are skipped.
    """
    scan = CallObjectScan()
    position = skip_whitespace(text, start)
    if position >= len(text):
        return scan
    if text[position] != "{":
        raise MalformedJSON(f"a tool call must be a JSON object, not text starting with {text[position]!r}")
    position += 1
    while True:
        position = skip_whitespace(text, position)
        if position >= len(text):
            return scan
        if text[position] == "}":
            scan.end = position + 1
            return scan
        if text[position] != '"':
            raise MalformedJSON(f"expected a key, found {text[position]!r}")
        key_end = string_end(text, position)
        if key_end is None:
            return scan
        key = json.loads(text[position:key_end])
        position = skip_whitespace(text, key_end)
        if position >= len(text):
            return scan
        if text[position] != ":":
            raise MalformedJSON(f"expected ':' after the key {key!r}")
        position = skip_whitespace(text, position + 1)
        if position >= len(text):
            return scan
        end = value_end(text, position)
        if key == name_key:
            if text[position] != '"':
                raise MalformedJSON(f"{name_key!r} must be a string")
            if end is None:
                return scan
            scan.name = json.loads(text[position:end])
        elif key in arguments_keys and scan.arguments_start is None:
            if text[position] != "{":
                raise MalformedJSON(f"{key!r} must be a JSON object")
            scan.arguments_start, scan.arguments_end = position, end
        if end is None:
            return scan
        position = skip_whitespace(text, end)
        if position >= len(text):
            return scan
        if text[position] == ",":
            position += 1
        elif text[position] != "}":
            raise MalformedJSON(f"expected ',' or '}}' after the value of {key!r}, found {text[position]!r}")
