"""The quantization config a model is being built with: how a linear layer learns its method at construction.

vLLM threads a `quant_config` argument through every model constructor. pagedserve's models build their linears
with HF-named prefixes and no such argument, so `load_model` (model_loader/model_factory.py) builds the model
inside `building_with_quantization(config)`, and each linear layer asks `quantized_linear_method(prefix)` for its
method when it creates its parameters. Outside that context (and for an unquantized checkpoint) every layer is
plain.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Iterator, Protocol

if TYPE_CHECKING:
    from pagedserve.layers.linear import LinearMethodBase


class LinearQuantization(Protocol):
    """What a checkpoint's quantization config answers while a model is built."""

    def linear_method(self, prefix: str) -> "LinearMethodBase | None":
        """The method of the linear layer named `prefix` (HF module name), None when it stays unquantized."""

    def experts_are_quantized(self, prefix: str) -> bool:
        """Whether the MoE experts named `prefix` are W8A8 int8 in the checkpoint (ValueError when they are
        quantized in a way pagedserve cannot run)."""


_building_with: ContextVar["LinearQuantization | None"] = ContextVar("pagedserve_quantization", default=None)


@contextmanager
def building_with_quantization(config: "LinearQuantization | None") -> Iterator[None]:
    """Layers constructed inside this block take their methods from `config` (None: all plain)."""
    token = _building_with.set(config)
    try:
        yield
    finally:
        _building_with.reset(token)


def quantized_linear_method(prefix: str) -> "LinearMethodBase | None":
    """The quantized method for the linear named `prefix` under the current config, or None."""
    config = _building_with.get()
    return None if config is None else config.linear_method(prefix)


def quantized_experts(prefix: str) -> bool:
    """Whether the current config quantizes the MoE experts named `prefix` (see LinearQuantization)."""
    config = _building_with.get()
    return config is not None and config.experts_are_quantized(prefix)
