"""pagedserve: a portable LLM inference and serving engine with vLLM's public conventions."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.lazy_names import lazy_attributes

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


__getattr__, __dir__ = lazy_attributes("pagedserve", globals(), _LAZY_NAMES)
