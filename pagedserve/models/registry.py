"""Model registry: HF `architectures[0]` -> implementing class, imported lazily."""
from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# architecture -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("pagedserve.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("pagedserve.models.mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("pagedserve.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("pagedserve.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("pagedserve.models.qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("pagedserve.models.qwen_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("pagedserve.models.mixtral", "MixtralForCausalLM"),
    "DeepseekV2ForCausalLM": ("pagedserve.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("pagedserve.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("pagedserve.models.deepseek_v32", "DeepseekV32ForCausalLM"),
    "Glm4MoeForCausalLM": ("pagedserve.models.glm4_moe", "Glm4MoeForCausalLM"),
    "GlmMoeDsaForCausalLM": ("pagedserve.models.glm_moe_dsa", "GlmMoeDsaForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def register_model(architecture: str, module_name: str, class_name: str) -> None:
    """Add (or replace) an implementation for an HF architecture name."""
    _MODELS[architecture] = (module_name, class_name)


def resolve_model_class(hf_config: Any) -> type[nn.Module]:
    """The class for `hf_config.architectures[0]`; ValueError naming the supported ones otherwise."""
    architectures = getattr(hf_config, "architectures", None) or []
    architecture = architectures[0] if architectures else None
    if architecture not in _MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {supported_architectures()}")
    module_name, class_name = _MODELS[architecture]
    return getattr(importlib.import_module(module_name), class_name)
