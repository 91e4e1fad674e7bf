"""Engine logprobs (list[dict[token id, Logprob]]) in OpenAI's two shapes.

Each row holds the scored token (sampled, or the actual prompt token) with its true rank, plus the
top-N tokens with ranks 1..N (see OutputProcessor); a token that is both appears once.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedserve.outputs import Logprob
from pagedserve.server.protocol import ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs

Row = dict[int, Logprob]


def _token_text(token_id: int, logprob: Logprob | None, decode: Callable[[int], str]) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return decode(token_id)


def _top_entries(row: Row, num_top: int) -> list[tuple[int, Logprob]]:
    """The row's top-`num_top` tokens in rank order."""
    entries = [(token_id, lp) for token_id, lp in row.items() if lp.rank is not None and 1 <= lp.rank <= num_top]
    return sorted(entries, key=lambda entry: entry[1].rank or 0)


def append_completion_logprobs(target: CompletionLogprobs, token_ids: Sequence[int], rows: Sequence[Row | None],
                               num_top: int, decode: Callable[[int], str], text_offset: int) -> int:
    """Append legacy completions logprobs for `token_ids` to `target`; returns the next text offset.

    A None row (the first prompt token, which nothing predicts) gives a None logprob.
    """
    for token_id, row in zip(token_ids, rows):
        scored = None if row is None else row.get(token_id)
        text = _token_text(token_id, scored, decode)
        target.tokens.append(text)
        target.text_offset.append(text_offset)
        text_offset += len(text)
        target.token_logprobs.append(None if scored is None else scored.logprob)
        if row is None:
            target.top_logprobs.append(None)
            continue
        top = {_token_text(tid, lp, decode): lp.logprob for tid, lp in _top_entries(row, num_top)}
        if scored is not None:
            top.setdefault(text, scored.logprob)
        target.top_logprobs.append(top)
    return text_offset


def chat_logprobs(token_ids: Sequence[int], rows: Sequence[Row], num_top: int,
                  decode: Callable[[int], str]) -> list[ChatTokenLogprob]:
    """Chat completions logprobs: one entry per generated token with its top-`num_top` alternatives."""
    content: list[ChatTokenLogprob] = []
    for token_id, row in zip(token_ids, rows):
        scored = row.get(token_id)
        text = _token_text(token_id, scored, decode)
        top = [ChatTopLogprob(token=(t := _token_text(tid, lp, decode)), logprob=lp.logprob,
                              bytes=list(t.encode("utf-8", "replace")))
               for tid, lp in _top_entries(row, num_top)]
        content.append(ChatTokenLogprob(token=text, logprob=scored.logprob if scored is not None else float("nan"),
                                        bytes=list(text.encode("utf-8", "replace")), top_logprobs=top))
    return content
