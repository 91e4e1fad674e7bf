"""The model runner's seam for batch_invariant=True, and the config checks that go with it.

`batch_invariant_step(execute_model, model)` swaps every paged Attention layer's backend for the
batch-invariant form of torch_paged (attention.py) and returns the runner's step wrapped so that it
runs under BatchInvariantMode (dispatch_mode.py): the model forward, the LM head, log_softmax and the
sampler all see invariant matmuls and reductions. With the mode off nothing here is imported or called.

Scope of the guarantee: a request's logits and logprobs are bitwise identical whatever else is in the
batch and however its prompt is cut into prefill chunks, for one engine configuration (model, dtype,
block size) and a fixed intra-op thread count (the GEMM kernels' thread split is part of their shape;
the step checks that the count has not changed since start). Sampled tokens are then identical for
greedy and seeded requests; unseeded random sampling draws from the global generator, whose stream the
other requests consume.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch
from torch import nn

from pagedserve.batch_invariant.attention import BatchInvariantPagedAttentionBackend
from pagedserve.batch_invariant.dispatch_mode import BatchInvariantMode

# Backends whose cache layout the batch-invariant attention reads (it replaces them in every layer).
SUPPORTED_ATTENTION_BACKENDS = ("torch_paged",)


def batch_invariant_from_env() -> bool:
    """vLLM's switch: VLLM_BATCH_INVARIANT=1 turns the mode on like batch_invariant=True."""
    return os.environ.get("VLLM_BATCH_INVARIANT", "0").strip().lower() in ("1", "true", "yes")


def check_batch_invariant_options(batch_invariant: Any, attention_backend: str | None,
                                  compilation_mode: str | None) -> None:
    """ValueError naming the knob when batch_invariant=True is combined with something it cannot cover."""
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"batch_invariant={batch_invariant!r} must be true or false")
    if not batch_invariant:
        return
    if attention_backend is not None and attention_backend not in SUPPORTED_ATTENTION_BACKENDS:
        raise ValueError(f"batch_invariant=True attends with a batch-invariant form of torch_paged; "
                         f"attention_backend={attention_backend!r} is not supported with it (allowed: "
                         f"{list(SUPPORTED_ATTENTION_BACKENDS)} or None)")
    if compilation_mode is not None and compilation_mode != "none":
        raise ValueError(f"batch_invariant=True reroutes ATen ops at run time, which a compiled forward "
                         f"bypasses; compilation_config.mode={compilation_mode!r} is not supported with it "
                         f"(set enforce_eager=True or compilation mode 'none')")


def install_batch_invariant_attention(model: nn.Module) -> int:
    """Give every paged Attention layer the batch-invariant backend; returns how many layers changed.

    Raises ValueError for attention layers of another kind (MLA's latent cache has no invariant form).
    """
    from pagedserve.layers.attention import Attention
    from pagedserve.worker.kv_cache_allocation import attention_layers

    num_layers = 0
    for layer in attention_layers(model):
        if not isinstance(layer, Attention):
            raise ValueError(f"batch_invariant=True supports paged multi-head attention layers only; "
                             f"{getattr(layer, 'layer_name', '?')} is a {type(layer).__name__}")
        layer.backend = BatchInvariantPagedAttentionBackend()
        num_layers += 1
    return num_layers


def batch_invariant_step(execute_model: Callable[..., Any], model: nn.Module) -> Callable[..., Any]:
    """The runner's step, batch invariant: attention layers switched, every call run in the mode."""
    install_batch_invariant_attention(model)
    num_threads = torch.get_num_threads()

    @functools.wraps(execute_model)
    def step(*args: Any, **kwargs: Any) -> Any:
        if torch.get_num_threads() != num_threads:
            raise RuntimeError(f"batch_invariant=True holds for a fixed thread count: torch's intra-op threads "
                               f"changed from {num_threads} to {torch.get_num_threads()} since start")
        with BatchInvariantMode():
            return execute_model(*args, **kwargs)

    return step


__all__ = ["SUPPORTED_ATTENTION_BACKENDS", "batch_invariant_from_env", "batch_invariant_step",
           "check_batch_invariant_options", "install_batch_invariant_attention"]
