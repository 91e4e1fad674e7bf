"""Truncation of the sampling distribution: min-p, top-k and top-p (nucleus), batched per row.

Each function masks the dropped tokens' logits to -inf and returns the truncated logits (callers use
the return value: the input may be modified in place). They run on temperature-scaled logits, in the
order min-p, top-k, top-p; top-p sees the distribution already renormalised over the top-k
survivors (vLLM's order). Top-k keeps tokens tied with the k-th logit, except on the candidates-only
path of apply_top_k_top_p, which sees just the max_top_k best.
"""
from __future__ import annotations

import torch


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p[row] times the row's top probability.

    Rows with min_p 0 keep everything; the top token always survives.
    """
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep the top_k[row] largest logits of each row (rows with top_k >= vocab keep all).

    Uses torch.topk(max_top_k) instead of a full sort; max_top_k is the largest enabled k (a host
    int, so no sync). Tokens tied with the k-th value are kept too.
    """
    vocab_size = logits.shape[1]
    top_values = logits.topk(max_top_k, dim=-1).values
    kth_index = (top_k.clamp(max=max_top_k) - 1).unsqueeze(1)
    threshold = top_values.gather(1, kth_index)
    threshold = torch.where(top_k.unsqueeze(1) >= vocab_size, float("-inf"), threshold)
    return logits.masked_fill_(logits < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor, max_top_k: int | None = None
) -> torch.Tensor:
    """Top-k (optional) then top-p, sorting once; returns the truncated logits.

    Top-p keeps the smallest set of most likely tokens whose probability sums to at least top_p
    (always at least the top token), measured on the distribution renormalised after top-k.
    Working on an ascending sort, a token is dropped when the mass of itself and everything less
    likely is <= 1 - top_p: cumulating from the small end keeps the tail sums accurate, and
    top_p = 1 then drops only zero-probability tokens.

    When every row has top-k enabled the caller passes max_top_k (the largest k): only the
    max_top_k best candidates are then sorted (torch.topk) instead of the whole vocabulary, and the
    result is a fresh tensor. Otherwise logits are sorted in full and modified in place.
    """
    if top_k is not None and max_top_k is not None:
        candidate_logits, candidate_ids = logits.topk(max_top_k, dim=-1)  # descending
        truncated = _top_k_top_p_on_ascending(candidate_logits.flip(-1), top_k, top_p)
        result = torch.full_like(logits, float("-inf"))
        return result.scatter_(1, candidate_ids.flip(-1), truncated)
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=False)
    truncated = _top_k_top_p_on_ascending(sorted_logits, top_k, top_p)
    return logits.scatter_(1, sorted_ids, truncated)


def _top_k_top_p_on_ascending(
    sorted_logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask (in place) ascending-sorted logits [num_rows, width] to top-k then top-p; returns them."""
    width = sorted_logits.shape[1]
    if top_k is not None:
        # The k-th largest sits at ascending position width - k; k >= width keeps the whole row.
        kth_position = (width - top_k.clamp(min=1, max=width)).unsqueeze(1)
        threshold = sorted_logits.gather(1, kth_position)
        sorted_logits.masked_fill_(sorted_logits < threshold, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    is_dropped = cumulative <= (1.0 - top_p).unsqueeze(1)
    is_dropped[:, -1] = False  # the most likely token always survives
    return sorted_logits.masked_fill_(is_dropped, float("-inf"))
