"""NgramProposer: prompt-lookup drafting (vLLM's method 'ngram').

For each request, the longest suffix of n tokens (prompt_lookup_max >= n >= prompt_lookup_min) that also occurs
earlier in the request's tokens proposes the up to K tokens that followed its most recent earlier occurrence.
Costs no model forward, so it pays whenever outputs quote their context (summaries, code edits, RAG answers).
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={prompt_lookup_min} and prompt_lookup_max={prompt_lookup_max} "
                             f"must satisfy 1 <= min <= max")
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose_one(self, token_ids: np.ndarray, num_speculative_tokens: int) -> np.ndarray:
        """Drafts (up to num_speculative_tokens, possibly none) continuing the 1-D `token_ids`."""
        num_tokens = len(token_ids)
        if num_speculative_tokens <= 0:
            return token_ids[:0]
        for n in range(min(self.prompt_lookup_max, num_tokens - 1), self.prompt_lookup_min - 1, -1):
            # Windows starting at 0..num_tokens-n-1: every occurrence that ends before the suffix itself does,
            # so at least one token follows it.
            windows = sliding_window_view(token_ids[:num_tokens - 1], n)
            is_match = (windows == token_ids[num_tokens - n:]).all(axis=1)
            matches = np.flatnonzero(is_match)
            if len(matches):
                start = int(matches[-1]) + n  # the most recent occurrence
                return token_ids[start:start + num_speculative_tokens]
        return token_ids[:0]

    def propose(self, token_rows: list[np.ndarray], num_speculative_tokens: int) -> list[list[int]]:
        """Drafts for each request's tokens (prompt and outputs so far, in order)."""
        return [self.propose_one(tokens, num_speculative_tokens).tolist() for tokens in token_rows]
