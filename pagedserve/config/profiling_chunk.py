"""ProfilingChunkConfig: profiling-tuned prefill chunk sizes (vllm-ascend's `profiling_chunk_config`).

At start the worker times forward passes of `chunk_sizes` tokens (and of a mid-size chunk over each of
`history_sizes` cached tokens), the engine fits a step-latency model, and each step the scheduler caps
a prefill chunk to the largest size predicted to keep the step within `target_tpot_ms` (default: the
predicted time of a full `max_num_batched_tokens` step without history). See
core/profiling_chunk_predictor.py and docs/params-01-scheduling.md.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class ProfilingChunkConfig:
    enable: bool = False
    # The step-time budget in milliseconds (each running decode gets one token per step); None: the
    # predicted time of a max_num_batched_tokens chunk with no history.
    target_tpot_ms: float | None = None
    # Chunk lengths timed at start (those above max_num_batched_tokens are skipped).
    chunk_sizes: tuple[int, ...] = (16, 64, 256, 512, 1024, 2048)
    # Cached-history lengths timed (at a 256-token chunk) to fit the history term.
    history_sizes: tuple[int, ...] = (1024, 2048)
    # EMA weight of the newest choice in (0, 1] (1: no smoothing).
    smoothing: float = 0.8
    # The smallest chunk ever chosen (aligned down to the block size, at least one block).
    min_chunk: int = 64

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunk_sizes", tuple(self.chunk_sizes))
        object.__setattr__(self, "history_sizes", tuple(self.history_sizes))
        if not isinstance(self.enable, bool):
            raise ValueError(f"profiling_chunk_config.enable={self.enable!r} must be a bool")
        if self.target_tpot_ms is not None and (
                isinstance(self.target_tpot_ms, bool) or not isinstance(self.target_tpot_ms, (int, float))
                or not self.target_tpot_ms > 0):
            raise ValueError(f"profiling_chunk_config.target_tpot_ms={self.target_tpot_ms!r} must be a number > 0 "
                             f"(or null: the predicted time of a full-budget chunk)")
        if len(set(self.chunk_sizes)) < 3 or not all(isinstance(n, int) and n >= 1 for n in self.chunk_sizes):
            raise ValueError(f"profiling_chunk_config.chunk_sizes={list(self.chunk_sizes)!r} must hold at least 3 "
                             f"distinct integers >= 1")
        if not all(isinstance(h, int) and h >= 1 for h in self.history_sizes):
            raise ValueError(f"profiling_chunk_config.history_sizes={list(self.history_sizes)!r} must be integers >= 1")
        if isinstance(self.smoothing, bool) or not isinstance(self.smoothing, (int, float)) \
                or not 0 < self.smoothing <= 1:
            raise ValueError(f"profiling_chunk_config.smoothing={self.smoothing!r} must be in (0, 1]")
        if not isinstance(self.min_chunk, int) or self.min_chunk < 1:
            raise ValueError(f"profiling_chunk_config.min_chunk={self.min_chunk!r} must be an integer >= 1")

    @staticmethod
    def parse(value: "ProfilingChunkConfig | dict[str, Any] | str | None") -> "ProfilingChunkConfig":
        """From a ProfilingChunkConfig, a dict, a JSON object string (the CLI form) or None (off)."""
        if value is None:
            return ProfilingChunkConfig()
        if isinstance(value, ProfilingChunkConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"profiling_chunk_config={value!r} is not a JSON object: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"profiling_chunk_config={value!r} must be a dict or a JSON object string")
        allowed = {f.name for f in fields(ProfilingChunkConfig)}
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise ValueError(f"profiling_chunk_config has unknown keys {unknown}; allowed: {sorted(allowed)}")
        return ProfilingChunkConfig(**value)


__all__ = ["ProfilingChunkConfig"]
