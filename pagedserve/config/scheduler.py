"""SchedulerConfig: token budget, batch size, chunking and policy."""
from __future__ import annotations

from dataclasses import dataclass

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    # A single prefill chunk never exceeds this many tokens (0: no extra cap beyond the budget).
    long_prefill_token_threshold: int = 0
    # Schedule step t+1 while step t executes (the engine keeps a queue of steps in flight).
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens!r} must be an integer >= 1")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs!r} must be an integer >= 1")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling={self.async_scheduling!r} must be true or false")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy={self.policy!r} must be one of {SCHEDULING_POLICIES}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len}; with enable_chunked_prefill=False a whole prompt must fit "
                f"in one step: raise max_num_batched_tokens or enable chunked prefill"
            )
