"""min_tokens: forbid stopping before a request has produced min_tokens tokens."""
from __future__ import annotations

import torch


def apply_min_tokens(logits: torch.Tensor, row_ids: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Return logits with logits[row_ids[j], token_ids[j]] = -inf (the input is not modified).

    The (row, token) pairs are the EOS and stop ids of rows still below min_tokens, prepared by
    build_sampling_metadata.
    """
    return logits.index_put((row_ids, token_ids), torch.tensor(float("-inf"), dtype=logits.dtype,
                                                               device=logits.device))
