"""EplbConfig: expert-parallel load balancing (EPLB) knobs.

`eplb_config` is given to EngineConfig.create / LLM(...) as a dict (or JSON text on the command line):
    {"enable": true, "step_interval": 600, "num_redundant_experts": 0, "policy": "default" | "flashlb",
     "window_size": 600}
Every `step_interval` forward steps the worker computes a new expert placement from the per-expert token
counts of the last `window_size` steps and moves the expert weights into their new slots.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

EPLB_POLICIES = ("default", "flashlb")


@dataclass(frozen=True)
class EplbConfig:
    enable: bool = False
    step_interval: int = 600
    num_redundant_experts: int = 0
    policy: str = "default"
    window_size: int = 600

    def __post_init__(self) -> None:
        if not isinstance(self.enable, bool):
            raise ValueError(f"eplb_config.enable={self.enable!r} must be true or false")
        for name in ("step_interval", "window_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"eplb_config.{name}={value!r} must be an integer >= 1")
        value = self.num_redundant_experts
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"eplb_config.num_redundant_experts={value!r} must be an integer >= 0")
        if self.policy not in EPLB_POLICIES:
            raise ValueError(f"eplb_config.policy={self.policy!r} must be one of {list(EPLB_POLICIES)}")

    @staticmethod
    def from_value(value: "EplbConfig | dict[str, Any] | str | None") -> "EplbConfig":
        """Accepts an EplbConfig, a dict, JSON text (the CLI flag) or None (disabled)."""
        if value is None:
            return EplbConfig()
        if isinstance(value, EplbConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"eplb_config={value!r} is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"eplb_config={value!r} must be a dict (or JSON object)")
        allowed = [field.name for field in fields(EplbConfig)]
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ValueError(f"eplb_config has unknown keys {unknown}; allowed: {allowed}")
        return EplbConfig(**value)
