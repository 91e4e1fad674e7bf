"""One engine's prefill and decode capacity for a workload, measured in process (`pagedserve bench pd`).

- Prefill: prompts drawn from the workload's length range (random token ids), each prefilled alone (max_tokens 1,
  prefix cache reset between them): the mean seconds per prompt and the prompt tokens per second.
- Decode: for each batch size B, B requests with prompts of the workload's mean length are prefilled, then the
  engine's next steps (every request decoding; the first two left out) are timed: t(B), the seconds per decode step at batch B.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedserve.sampling_params import SamplingParams

@dataclass
class Capacity:
    """One instance's measurements (what pd_split.py turns into rates)."""

    prefill_seconds: list[float] = field(default_factory=list)  # per measured prompt
    prefill_prompt_lens: list[int] = field(default_factory=list)
    step_seconds: dict[int, float] = field(default_factory=dict)  # t(B), decode step at batch B

    @property
    def mean_prefill_seconds(self) -> float:
        return float(np.mean(self.prefill_seconds))

    @property
    def prefill_tokens_per_second(self) -> float:
        return sum(self.prefill_prompt_lens) / sum(self.prefill_seconds)


def measure_capacity(engine: Any, prompt_len_range: tuple[int, int], batch_sizes: list[int], *,
                     num_prefill_prompts: int = 8, num_decode_steps: int = 16, seed: int = 0,
                     vocab_range: tuple[int, int] = (100, 1000)) -> Capacity:
    """Measure `engine` (an LLMEngine) for the workload; prompt token ids are drawn from vocab_range (see the
    module docstring)."""
    low, high = prompt_len_range
    if not 1 <= low <= high:
        raise ValueError(f"prompt_len_range=[{low}, {high}] must satisfy 1 <= MIN <= MAX")
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch_sizes={batch_sizes} must be batch sizes >= 1")
    rng = np.random.default_rng(seed)

    def _random_prompt(rng: np.random.Generator, length: int) -> dict[str, list[int]]:
        return {"prompt_token_ids": rng.integers(*vocab_range, size=length).tolist()}

    capacity = Capacity()
    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    counter = iter(range(1 << 62))

    def run_to_end() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    # Warm-up: the first steps of an engine pay one-off costs (allocations, lazy kernels), prefill and decode.
    engine.add_request(f"warmup-{next(counter)}", _random_prompt(rng, low),
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    run_to_end()
    # Evenly over the range (random ids, so no prefix-cache hits), each prompt alone.
    for length in np.linspace(low, high, num_prefill_prompts).round().astype(int).tolist():
        engine.reset_prefix_cache()
        start = time.perf_counter()
        engine.add_request(f"prefill-{next(counter)}", _random_prompt(rng, length), one_token)
        run_to_end()
        capacity.prefill_seconds.append(time.perf_counter() - start)
        capacity.prefill_prompt_lens.append(length)
    mean_len = int(round((low + high) / 2))
    # Steps right after a prefill are slower (first touches of the new pages): two are left untimed.
    num_untimed_steps = 2
    decode = SamplingParams(temperature=0, max_tokens=num_decode_steps + num_untimed_steps + 3, ignore_eos=True)
    for batch_size in sorted(set(batch_sizes)):
        for _ in range(batch_size):
            engine.add_request(f"decode-{next(counter)}", _random_prompt(rng, mean_len), decode)
        # Until every request has its first token (all prefills done), then time the pure decode steps.
        num_started: set[str] = set()
        while len(num_started) < batch_size:
            for output in engine.step():
                if output.outputs and output.outputs[0].token_ids:
                    num_started.add(output.request_id)
        for _ in range(num_untimed_steps):
            engine.step()
        start = time.perf_counter()
        for _ in range(num_decode_steps):
            engine.step()
        capacity.step_seconds[batch_size] = (time.perf_counter() - start) / num_decode_steps
        run_to_end()
    return capacity
