"""Apply a step's grammar bitmask to the logits of its constrained rows (the model runner's one call).

`apply_grammar_bitmask` uses xgrammar's CPU kernel; `apply_grammar_bitmask_reference` is the plain-torch
oracle (unpack the bits, masked_fill) the tests compare it with. Disallowed tokens get -inf; rows of requests
without a constraint are left as they are. Greedy steps that take the argmax inside the LM head
(sample/fused_greedy_head.py, the native decode stack's greedy rows) get the words of `bitmask_of_rows` instead of
logits to mask: their kernels count a disallowed token as -inf (kernels/cpu/allowed_tokens.h).
"""
from __future__ import annotations

import torch

from pagedserve.core.scheduler_output import GrammarBitmask


def bitmask_words(grammar_bitmask: GrammarBitmask) -> torch.Tensor:
    """The bitmask as an int32 tensor [num_rows, num_words] (a copy: the message's bytes are read-only)."""
    words = torch.frombuffer(bytearray(grammar_bitmask.bitmask), dtype=torch.int32)
    return words.view(grammar_bitmask.num_rows, grammar_bitmask.num_words)


def constrained_rows(grammar_bitmask: GrammarBitmask, row_request_ids: list[str],
                     row_positions: list[int] | None = None) -> tuple[list[int], list[int]]:
    """(logits rows, bitmask rows) of the constrained requests, when logits row i scores position
    row_positions[i] (0: the next token, j: after the request's first j drafts; default 0) of row_request_ids[i]."""
    first_row = grammar_bitmask.first_row
    logit_rows = [row for row, request_id in enumerate(row_request_ids) if request_id in first_row]
    return logit_rows, [first_row[row_request_ids[row]] + (row_positions[row] if row_positions else 0)
                        for row in logit_rows]


def bitmask_of_rows(grammar_bitmask: GrammarBitmask, row_request_ids: list[str],
                    row_positions: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """(int32 words [len(row_request_ids), num_words], the constrained rows): row i holds the allowed tokens of
    row_request_ids[i] (at draft position row_positions[i]), every bit set for a request without a constraint."""
    logit_rows, mask_rows = constrained_rows(grammar_bitmask, row_request_ids, row_positions)
    bitmask = torch.full((len(row_request_ids), grammar_bitmask.num_words), -1, dtype=torch.int32)
    if logit_rows:
        bitmask[logit_rows] = bitmask_words(grammar_bitmask)[mask_rows]
    return bitmask, logit_rows


def apply_grammar_bitmask(logits: torch.Tensor, grammar_bitmask: GrammarBitmask, row_request_ids: list[str],
                          row_positions: list[int] | None = None) -> None:
    """Mask `logits` [num_rows, vocab] in place: row i belongs to row_request_ids[i] (at draft position
    row_positions[i] with speculative decoding)."""
    # xgrammar indexes the logits and the bitmask with the same row numbers: the masks laid out like the logits.
    bitmask, logit_rows = bitmask_of_rows(grammar_bitmask, row_request_ids, row_positions)
    if not logit_rows:
        return
    import xgrammar  # only steps with constrained rows need it

    xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=logit_rows)


def allowed_token_mask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [num_rows, vocab_size] from int32 words [num_rows, num_words]: bit j of word w is token 32*w + j."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # an arithmetic shift: bit 31 of a negative word still reads 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()


def apply_grammar_bitmask_reference(logits: torch.Tensor, grammar_bitmask: GrammarBitmask,
                                    row_request_ids: list[str], row_positions: list[int] | None = None) -> None:
    """The plain-torch form of apply_grammar_bitmask (same result)."""
    logit_rows, mask_rows = constrained_rows(grammar_bitmask, row_request_ids, row_positions)
    if not logit_rows:
        return
    allowed = allowed_token_mask(bitmask_words(grammar_bitmask)[mask_rows], logits.shape[1])
    logits[logit_rows] = logits[logit_rows].masked_fill(~allowed, float("-inf"))
