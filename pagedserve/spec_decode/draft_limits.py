"""How many drafts a request may take this step."""
from __future__ import annotations

from pagedserve.worker.input_batch import RequestState


def num_drafts_allowed(state: RequestState, num_known: int, num_speculative_tokens: int, max_model_len: int) -> int:
    """K, cut so that the drafts' KV positions (up to num_known + k - 2) and the verified positions (up to
    num_known + k) stay inside max_model_len, and the k + 1 tokens a step may emit stay within max_tokens."""
    k = min(num_speculative_tokens, max_model_len - num_known - 1)
    max_tokens = state.sampling_params.max_tokens
    if max_tokens is not None:
        k = min(k, max_tokens - (num_known - state.num_prompt_tokens) - 1)
    return max(k, 0)


__all__ = ["num_drafts_allowed"]
