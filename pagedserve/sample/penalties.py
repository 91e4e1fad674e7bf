"""Repetition, frequency and presence penalties (vLLM / OpenAI / HF semantics), batched."""
from __future__ import annotations

import torch


def count_token_occurrences(padded_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Count each token id per row: [num_rows, max_len] ids padded with vocab_size -> [num_rows, vocab_size].

    Counts are float32 (exact far beyond any sequence length) so they feed the logits arithmetic
    directly. The padding id lands in an extra column that is dropped, so padding is never counted.
    """
    num_rows = padded_token_ids.shape[0]
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=padded_token_ids.device)
    counts.scatter_add_(1, padded_token_ids, torch.ones(padded_token_ids.shape, dtype=torch.float32,
                                                        device=padded_token_ids.device))
    return counts[:, :vocab_size]


def token_presence(padded_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[num_rows, vocab_size] bool: whether each token id occurs in the row (padding ignored)."""
    num_rows = padded_token_ids.shape[0]
    is_present = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=padded_token_ids.device)
    is_present.scatter_(1, padded_token_ids, True)
    return is_present[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Return penalised logits (the input is not modified).

    - repetition (HF style): for tokens seen in the prompt or the output, a positive logit is divided
      by the penalty and a non-positive one multiplied by it, so a penalty > 1 always discourages;
    - frequency: subtract penalty * (times the token appears in the output);
    - presence: subtract penalty once if the token appears in the output at all.
    Token id tensors are right-padded with vocab_size (see SamplingMetadata).
    """
    vocab_size = logits.shape[1]
    output_counts = count_token_occurrences(output_token_ids, vocab_size)
    is_in_output = output_counts > 0
    is_seen = token_presence(prompt_token_ids, vocab_size).logical_or_(is_in_output)
    factor = torch.where(is_seen, repetition_penalties.unsqueeze(1), 1.0)
    penalised = torch.where(logits > 0, logits / factor, logits * factor)
    penalised -= frequency_penalties.unsqueeze(1) * output_counts
    penalised -= presence_penalties.unsqueeze(1) * is_in_output
    return penalised
