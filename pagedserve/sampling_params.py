"""SamplingParams: how to sample one request, with vLLM's field names and validation."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from pagedserve.structured_output.structured_outputs_params import StructuredOutputsParams

# Greedy sampling is temperature below this (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20
# The seeds the sampler takes: torch.Generator.manual_seed accepts [-2**63, 2**64 - 1] (a negative seed is
# read as its 64-bit two's complement), and so do the msgpack messages that carry it to the engine process.
MIN_SEED = -(2 ** 63)
MAX_SEED = 2 ** 64 - 1


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """Per-request sampling settings. Field names and meanings follow vllm.SamplingParams.

    Raises ValueError at construction for out-of-range values, naming the field, value and range.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Extra per-request arguments for engine plug-ins (vLLM's name); "kv_transfer_params" drives the KV connector
    # (pagedserve/kv_transfer/kv_transfer_params.py).
    extra_args: dict[str, Any] | None = None
    # The output must match this JSON schema / regex / choice / grammar (pagedserve/structured_output/).
    structured_outputs: StructuredOutputsParams | None = None
    # Set by the engine, not by users: the tokenizer's EOS ids (generation_config may add more).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self._verify()
        if self.temperature < SAMPLING_EPS:
            # Greedy: the other knobs do not change the argmax; normalise them so batching is simple.
            self.top_p = 1.0
            self.top_k = -1
            self.min_p = 0.0

    def _verify(self) -> None:
        def require(condition: bool, message: str) -> None:
            if not condition:
                raise ValueError(message)

        require(isinstance(self.n, int) and self.n >= 1, f"n={self.n!r} must be an integer >= 1")
        require(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty={self.presence_penalty!r} must be in [-2, 2]")
        require(-2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty={self.frequency_penalty!r} must be in [-2, 2]")
        require(self.repetition_penalty > 0.0, f"repetition_penalty={self.repetition_penalty!r} must be > 0")
        require(self.temperature >= 0.0, f"temperature={self.temperature!r} must be >= 0")
        require(0.0 < self.top_p <= 1.0, f"top_p={self.top_p!r} must be in (0, 1]")
        require(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
                f"top_k={self.top_k!r} must be -1 or 0 (disabled) or an integer >= 1")
        require(0.0 <= self.min_p <= 1.0, f"min_p={self.min_p!r} must be in [0, 1]")
        require(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        require(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
                f"min_tokens={self.min_tokens!r} must be an integer >= 0")
        require(self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            require(value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS),
                    f"{name}={value!r} must be an integer in [0, {MAX_LOGPROBS}]")
        require(self.seed is None or isinstance(self.seed, int), f"seed={self.seed!r} must be an integer")
        # Sample i of n uses seed + i (parallel_sampling.py), so every one of them must be a seed the sampler takes.
        max_seed = MAX_SEED - (self.n - 1)
        require(self.seed is None or MIN_SEED <= self.seed <= max_seed,
                f"seed={self.seed!r} must be in [{MIN_SEED}, {MAX_SEED}], the sampler's seed range"
                if self.n == 1 else
                f"seed={self.seed!r} with n={self.n} must be in [{MIN_SEED}, {max_seed}]: sample i uses seed + i, "
                f"and the sampler's seed range is [{MIN_SEED}, {MAX_SEED}]")
        require(all(isinstance(s, str) and s for s in self.stop), f"stop={self.stop!r} must be non-empty strings")
        require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                f"stop_token_ids={self.stop_token_ids!r} must be non-negative integers")
        require(self.extra_args is None or isinstance(self.extra_args, dict),
                f"extra_args={self.extra_args!r} must be a dict or None")
        if self.extra_args is not None and self.extra_args.get("kv_transfer_params") is not None:
            from pagedserve.kv_transfer.kv_transfer_params import KVTransferParams

            KVTransferParams.parse(self.extra_args["kv_transfer_params"], self.max_tokens)
            require(self.n == 1, f"n={self.n} must be 1 with kv_transfer_params (one request, one set of blocks)")
        require(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
                f"structured_outputs={self.structured_outputs!r} must be a StructuredOutputsParams or None")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM_SEED if self.seed is not None else SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    def clone(self, **changes: object) -> "SamplingParams":
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values["stop"] = list(self.stop)
        values["stop_token_ids"] = list(self.stop_token_ids)
        values["all_stop_token_ids"] = set(self.all_stop_token_ids)
        values.update(changes)
        return SamplingParams(**values)
