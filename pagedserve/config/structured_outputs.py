"""StructuredOutputsConfig: the grammar engine behind structured outputs (pagedserve/structured_output/)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pagedserve.config.knob_dict import config_from_dict

STRUCTURED_OUTPUT_BACKENDS = ("xgrammar",)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    # The grammar engine; xgrammar runs on the CPU.
    backend: str = "xgrammar"
    # Threads that compile grammars off the engine loop (a request waits in the scheduler until its grammar is ready).
    num_compile_threads: int = 1
    # Distinct compiled grammars kept (least recently used dropped first).
    grammar_cache_size: int = 256
    # The reasoning model's parser (pagedserve/reasoning/): the server splits reasoning_content from content, and
    # a request's grammar applies only after its reasoning ends. None: no reasoning.
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"structured_outputs_config.backend={self.backend!r} must be one of "
                             f"{list(STRUCTURED_OUTPUT_BACKENDS)}")
        for name in ("num_compile_threads", "grammar_cache_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"structured_outputs_config.{name}={value!r} must be an integer >= 1")
        if self.reasoning_parser is not None:
            from pagedserve.reasoning.reasoning_parser import REASONING_PARSERS

            if self.reasoning_parser not in REASONING_PARSERS:
                raise ValueError(f"reasoning_parser={self.reasoning_parser!r} must be one of "
                                 f"{sorted(REASONING_PARSERS)} (or None)")

    def with_reasoning_parser(self, reasoning_parser: str | None) -> "StructuredOutputsConfig":
        """This config with `reasoning_parser` set (the --reasoning-parser flag); unchanged for None."""
        return self if reasoning_parser is None else dataclasses.replace(self, reasoning_parser=reasoning_parser)

    @staticmethod
    def parse(value: "StructuredOutputsConfig | dict[str, Any] | str | None") -> "StructuredOutputsConfig":
        """From a StructuredOutputsConfig, a dict, a JSON object string (the CLI form) or None (the defaults)."""
        if value is None:
            return StructuredOutputsConfig()
        if isinstance(value, StructuredOutputsConfig):
            return value
        return config_from_dict(StructuredOutputsConfig, "structured_outputs_config", value)


__all__ = ["StructuredOutputsConfig"]
