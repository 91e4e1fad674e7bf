"""pagedserve: a portable LLM inference and serving engine with vLLM's public conventions."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.config.engine import EngineConfig
    from pagedserve.llm import LLM
    from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
    from pagedserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineConfig",
           "__version__"]

# The public names, imported on first use: `import pagedserve` (and the `pagedserve` command's argument parsing)
# does not import torch, so a command decides itself what it loads.
_LAZY_NAMES = {
    "LLM": "pagedserve.llm",
    "SamplingParams": "pagedserve.sampling_params",
    "RequestOutput": "pagedserve.outputs",
    "CompletionOutput": "pagedserve.outputs",
    "Logprob": "pagedserve.outputs",
    "EngineConfig": "pagedserve.config.engine",
}


def __getattr__(name: str) -> Any:
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_NAMES))
