"""Qwen2: the Llama decoder with biases on the q/k/v projections (none on o_proj)."""
from __future__ import annotations

from typing import Any

from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    @classmethod
    def projection_biases(cls, hf_config: Any) -> tuple[bool, bool]:
        return True, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Sliding window only where the config enables it (`use_sliding_window`, per `layer_types`)."""

    attention_class = Qwen2Attention
