"""SpecDecodeStats: the scheduler's cumulative speculative-decoding counters (vLLM's vllm:spec_decode_*)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # requests-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [position] drafts accepted at draft position `position` (0: the first draft of a step).
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verification: num_accepted_tokens of its num_draft_tokens drafts were kept (a prefix)."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(f"num_accepted_tokens={num_accepted_tokens} must be in [0, num_draft_tokens="
                             f"{num_draft_tokens}]")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_position = self.num_accepted_tokens_per_pos
        if len(per_position) < num_draft_tokens:
            per_position.extend([0] * (num_draft_tokens - len(per_position)))
        for position in range(num_accepted_tokens):
            per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step: accepted drafts plus the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
