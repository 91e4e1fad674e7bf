"""Mistral: the Llama decoder with a sliding attention window taken from the config."""
from __future__ import annotations

from pagedserve.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Same layers and names as Llama; `sliding_window` is applied per layer by `layer_sliding_window`."""
