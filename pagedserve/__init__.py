"""pagedserve: a portable LLM inference and serving engine with vLLM's public conventions."""
from pagedserve.config.engine import EngineConfig
from pagedserve.llm import LLM
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineConfig",
           "__version__"]
