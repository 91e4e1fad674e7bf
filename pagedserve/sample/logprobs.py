"""Logprobs of sampled (or prompt) tokens plus the top-N alternatives, as batched tensors.

Logprobs are vLLM's default 'raw_logprobs': log_softmax of the model's logits before any penalty,
temperature or truncation. A token's rank is 1 + the number of tokens with a strictly greater logprob.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.core.scheduler_output import LogprobsLists


@dataclass
class LogprobsTensors:
    """Column 0 is the scored token (sampled, or the prompt's next token); columns 1..N the top-N.

    logprob_token_ids: [num_rows, N + 1] int64; logprobs: [num_rows, N + 1] float32;
    sampled_token_ranks: [num_rows] int64 (rank of the column-0 token).
    """

    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    sampled_token_ranks: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.logprob_token_ids.shape[0]

    @property
    def max_num_logprobs(self) -> int:
        """N: how many top logprobs each row holds after the scored token."""
        return self.logprob_token_ids.shape[1] - 1

    def to_lists(self) -> LogprobsLists:
        """All rows and columns as Python lists (one device-to-host copy per tensor)."""
        return LogprobsLists(
            logprob_token_ids=self.logprob_token_ids.tolist(),
            logprobs=self.logprobs.tolist(),
            sampled_token_ranks=self.sampled_token_ranks.tolist(),
        )

    def to_lists_per_row(self, num_logprobs_per_row: Sequence[int | None]) -> list[LogprobsLists | None]:
        """One single-row LogprobsLists per row, cut to that row's own N (None where it is None).

        Copies to the host once, then slices in Python: what the model runner needs to hand each
        request exactly the logprobs it asked for.
        """
        if len(num_logprobs_per_row) != self.num_rows:
            raise ValueError(f"len(num_logprobs_per_row)={len(num_logprobs_per_row)} must equal "
                             f"num_rows={self.num_rows}")
        for row, num_logprobs in enumerate(num_logprobs_per_row):
            if num_logprobs is not None and not 0 <= num_logprobs <= self.max_num_logprobs:
                raise ValueError(f"num_logprobs_per_row[{row}]={num_logprobs} must be in "
                                 f"[0, {self.max_num_logprobs}]")
        everything = self.to_lists()
        return [None if num_logprobs is None else everything.slice(row, num_logprobs)
                for row, num_logprobs in enumerate(num_logprobs_per_row)]


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the vocabulary, in float32."""
    return logits.to(torch.float32).log_softmax(dim=-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Pick token_ids[row]'s logprob and rank, plus the row's top num_logprobs tokens."""
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    top_logprobs, top_token_ids = logprobs.topk(num_logprobs, dim=-1)
    return LogprobsTensors(
        logprob_token_ids=torch.cat([token_ids, top_token_ids], dim=1),
        logprobs=torch.cat([token_logprobs, top_logprobs], dim=1),
        sampled_token_ranks=ranks,
    )


def compute_prompt_logprobs(
    logits: torch.Tensor, target_token_ids: torch.Tensor | Sequence[int], num_logprobs: int
) -> LogprobsTensors:
    """Logprobs of prompt tokens: row i scores target_token_ids[i] under logits[i].

    Position i's logits predict token i + 1, so for a prompt chunk the caller passes the logits of
    positions [start, end) and the prompt tokens [start + 1, end + 1). Raises ValueError on bad shapes.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits.shape={tuple(logits.shape)} must be 2-D [num_positions, vocab_size]")
    num_positions, vocab_size = logits.shape
    if not isinstance(target_token_ids, torch.Tensor):
        target_token_ids = torch.tensor(list(target_token_ids), dtype=torch.int64)
    target_token_ids = target_token_ids.to(device=logits.device, dtype=torch.int64)
    if target_token_ids.shape != (num_positions,):
        raise ValueError(f"target_token_ids.shape={tuple(target_token_ids.shape)} must be ({num_positions},), "
                         "one target per logits row")
    if not isinstance(num_logprobs, int) or not 0 <= num_logprobs <= vocab_size:
        raise ValueError(f"num_logprobs={num_logprobs!r} must be an integer in [0, {vocab_size}]")
    if num_positions > 0:
        lowest, highest = int(target_token_ids.min()), int(target_token_ids.max())
        if lowest < 0 or highest >= vocab_size:
            bad = lowest if lowest < 0 else highest
            raise ValueError(f"target_token_ids contains {bad}, outside [0, {vocab_size - 1}]")
    return gather_logprobs(compute_logprobs(logits), target_token_ids, num_logprobs)
