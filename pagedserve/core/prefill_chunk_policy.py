"""PrefillChunkPolicy: how many prefill tokens one request may compute in this step.

The scheduler asks the policy once per prefill chunk it is about to schedule, telling it how many
other tokens (running decodes plus earlier chunks) the step already holds and how many tokens of the
request are already computed (its history: the chunk attends to them). The answer caps the chunk on
top of the token budget, `long_prefill_token_threshold` and `max_model_len`. The default policy
returns None (no extra cap): today's behaviour. Pure Python, like the rest of core/.
"""
from __future__ import annotations

from abc import ABC, abstractmethod


class PrefillChunkPolicy(ABC):
    @abstractmethod
    def prefill_token_cap(self, num_other_tokens: int, num_history_tokens: int) -> int | None:
        """The most tokens one prefill chunk may have this step (>= 1), or None for no cap."""


class UncappedPrefillChunkPolicy(PrefillChunkPolicy):
    """The default: chunks are limited only by the token budget and the scheduler's own caps."""

    def prefill_token_cap(self, num_other_tokens: int, num_history_tokens: int) -> int | None:
        return None


__all__ = ["PrefillChunkPolicy", "UncappedPrefillChunkPolicy"]
