"""Incremental detokenization of one request's output, with stop strings and streaming holdback.

Decoding: byte-level BPE tokens are byte strings, so a multi-byte UTF-8 character can be split across
tokens, and some tokenizers (SentencePiece) render a token differently at the start of a text. We keep
two offsets into the token ids (prompt tail + outputs), vLLM's technique:
  - `prefix_offset`: start of a small context window (so leading-space rules see the previous token);
  - `read_offset`: end of the text already emitted.
Each new token: new_text = decode(ids[prefix:]) minus decode(ids[prefix:read]). When new_text ends in
U+FFFD the last character is still incomplete, so nothing is emitted and the offsets stay; once it
completes, the whole character comes out and both offsets move forward. Invariant: `read_offset` is a
character boundary, so the window decode from it agrees with a full decode. Work per token is bounded by
the window (a few tokens), not by the output length. On finish, pending bytes are flushed even if
invalid, so the final text equals a full decode of the output tokens.

Stop strings: after each update we look for stop strings ending in the new text (one may span
tokens). The match that completes first wins (ties: the one that starts first). The text is cut before
the stop string, or after it with include_stop_str_in_output.

Streaming holdback: when cutting before a stop string, text already shown could turn out to be the start
of a stop string. So `get_next_output_text` holds back the longest tail of the text that is a proper
prefix of some stop string, until it is either completed (cut) or broken (released). Emitted text is
therefore never retracted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.sampling_params import SamplingParams

REPLACEMENT_CHARACTER = "\ufffd"
# Prompt tokens kept as decoding context for the first output tokens (vLLM uses 5 too).
NUM_PROMPT_CONTEXT_TOKENS = 5


@dataclass(frozen=True)
class StopStringMatch:
    stop_string: str
    # Length of the text to keep.
    truncate_to: int


def find_stop_string(text: str, check_from: int, stop_strings: list[str],
                     include_stop_str_in_output: bool) -> StopStringMatch | None:
    """The first stop string that completes after text position `check_from`, or None.

    Only matches ending after `check_from` count (the text before was checked already) but a match may
    start earlier. Among matches the one ending first wins, then the one starting first.
    """
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for stop in stop_strings:
        start = text.find(stop, max(0, check_from - len(stop) + 1))
        if start < 0:
            continue
        candidate = (start + len(stop), start, stop)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    if best is None:
        return None
    end, start, stop = best
    return StopStringMatch(stop, end if include_stop_str_in_output else start)


def num_stop_prefix_chars(text: str, stop_strings: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stop_strings:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


class IncrementalDetokenizer:
    """Detokenizes one request's output tokens as they arrive and applies its stop strings.

    `output_text` is the full text so far (cut at a stop string once one hit);
    `get_next_output_text` is what may be shown to a user now (cumulative or delta).
    With `params.detokenize` False or no tokenizer, no text is produced.
    """

    def __init__(self, tokenizer: Any | None, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer if params.detokenize else None
        self.skip_special_tokens = params.skip_special_tokens
        self.spaces_between_special_tokens = params.spaces_between_special_tokens
        self.stop_strings: list[str] = list(params.stop) if self.tokenizer is not None else []
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.special_token_ids: frozenset[int] = frozenset(
            getattr(self.tokenizer, "all_special_ids", None) or []) if self.tokenizer is not None else frozenset()

        context = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        # Prompt context followed by every output token (the decode window is a suffix of this).
        self.token_ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.num_output_tokens = 0
        self.output_text = ""
        self.stop_string: str | None = None
        self._last_output_text_offset = 0

    # -- decoding ---------------------------------------------------------------------------------
    def _decode(self, token_ids: list[int]) -> str:
        """Decode a window. With special tokens kept and spaces_between_special_tokens, special tokens
        are set apart by single spaces (as HF's slow tokenizers do); otherwise the tokenizer decodes."""
        assert self.tokenizer is not None
        if (self.skip_special_tokens or not self.spaces_between_special_tokens
                or self.special_token_ids.isdisjoint(token_ids)):
            return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens,
                                         clean_up_tokenization_spaces=False)
        pieces: list[str] = []
        run: list[int] = []
        for token_id in token_ids:
            if token_id in self.special_token_ids:
                if run:
                    pieces.append(self.tokenizer.decode(run, clean_up_tokenization_spaces=False))
                    run = []
                pieces.append(self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False))
            else:
                run.append(token_id)
        if run:
            pieces.append(self.tokenizer.decode(run, clean_up_tokenization_spaces=False))
        return " ".join(pieces)

    def _decode_pending(self, flush: bool) -> str:
        """Text of the tokens after read_offset, or "" while the last character is incomplete."""
        if self.read_offset >= len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if not flush and (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHARACTER)):
            # An incomplete UTF-8 sequence (or nothing visible yet): wait for more tokens.
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text):]

    # -- updates ------------------------------------------------------------------------------------
    def update(self, new_token_ids: list[int], finished: bool = False, stop_terminated: bool = False) -> str | None:
        """Add this step's tokens; return the stop string that hit, if any (then output_text is cut).

        `finished`: the engine finished the request this step (pending bytes are flushed).
        `stop_terminated`: it finished on a stop token (EOS or stop_token_ids), which is then not
        detokenized unless include_stop_str_in_output (vLLM's rule).
        """
        if self.stop_string is not None:
            return None  # Already stopped: later tokens are not part of the output.
        self.num_output_tokens += len(new_token_ids)
        if self.tokenizer is None:
            return None
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        check_from = len(self.output_text)
        num_earlier_tokens = self.num_output_tokens - len(new_token_ids)
        for position, token_id in enumerate(new_token_ids):
            self.token_ids.append(token_id)
            self.output_text += self._decode_pending(flush=False)
            if self.min_tokens and num_earlier_tokens + position + 1 <= self.min_tokens:
                # Text from the first min_tokens tokens may not end in a stop string (vLLM's rule).
                check_from = len(self.output_text)
        if finished:
            self.output_text += self._decode_pending(flush=True)
        if not self.stop_strings or len(self.output_text) <= check_from:
            return None
        match = find_stop_string(self.output_text, check_from, self.stop_strings, self.include_stop_str_in_output)
        if match is None:
            return None
        self.output_text = self.output_text[:match.truncate_to]
        self.stop_string = match.stop_string
        return match.stop_string

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to show now: all of it (delta=False) or what is new since the last call (delta=True).

        Unless finished, a tail that could start a stop string is held back (never shown, then
        retracted). With include_stop_str_in_output the cut lies after the stop string, so nothing
        shown can be cut and nothing is held back.
        """
        visible = len(self.output_text)
        if not finished and self.stop_strings and not self.include_stop_str_in_output:
            visible -= num_stop_prefix_chars(self.output_text, self.stop_strings)
        # Monotonic: a held-back tail only ever grows from text not yet shown.
        visible = max(visible, self._last_output_text_offset)
        if not delta:
            self._last_output_text_offset = visible
            return self.output_text[:visible]
        start = self._last_output_text_offset
        self._last_output_text_offset = visible
        return self.output_text[start:visible]
