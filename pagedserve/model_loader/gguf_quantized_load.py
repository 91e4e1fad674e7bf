"""Which modules of a model built for a GGUF file keep the file's quantized blocks, and turning them into such
modules before the weights load (layers/gguf_linear.py computes with them).

A module keeps its blocks when every checkpoint tensor it loads (a fused layer's parts: q/k/v, gate/up) has one
ggml type the kernels read, it runs on the CPU on one tensor-parallel rank, and its rows are whole blocks. Anything
else (norms, float tensors, a fused layer whose parts mix types, as Q4_K_M files do for attn_v) loads dequantized
as before. A tied LM head shares its embedding's blocks. After loading, `interleave_kept_modules` puts each kept
weight in the interleaved layout its kernels read fastest, where they have one (layers/gguf_linear.py).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.gguf_linear import (BLOCK_FORMATS, GGUF_LINEAR_METHOD, KERNEL_TYPES, interleave_weight,
                                           interleaves, row_bytes)
from pagedserve.layers.linear import UNQUANTIZED_LINEAR_METHOD, LinearBase

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeptQuantizedModule:
    """A module that will hold `ggml_type` blocks of the checkpoint tensors `checkpoint_names`."""

    name: str
    module: nn.Module
    ggml_type: int
    checkpoint_names: tuple[str, ...]


def _checkpoint_names(model: nn.Module, module_name: str) -> tuple[str, ...]:
    """The HF tensor names a module's weight loads from: a fused layer's parts (the model's
    stacked_params_mapping), else its own name."""
    parts = []
    for fused, checkpoint_name, _ in getattr(model, "stacked_params_mapping", ()):
        if module_name.endswith(f".{fused}"):
            parts.append(f"{module_name[:-len(fused)]}{checkpoint_name}.weight")
    return tuple(parts) or (f"{module_name}.weight",)


def _row_values(module: nn.Module) -> int:
    if isinstance(module, LinearBase):
        return module.input_size_per_partition
    return module.embedding_dim


def plan_kept_quantized(model: nn.Module, tensor_types: dict[str, int]) -> list[KeptQuantizedModule]:
    """The modules of `model` that keep their blocks, given the checkpoint's {HF tensor name: ggml type}."""
    kept = []
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            if module.tp_size != 1 or module.linear_method is not UNQUANTIZED_LINEAR_METHOD \
                    or module.weight_read_elsewhere:
                continue
        elif isinstance(module, VocabParallelEmbedding):
            if module.tp_size != 1 or (isinstance(module, ParallelLMHead) and module.is_tied):
                continue  # a tied head follows its embedding (convert_kept_modules)
        else:
            continue
        if module.weight.device.type != "cpu":
            continue
        names = _checkpoint_names(model, name)
        types = {tensor_types.get(checkpoint_name) for checkpoint_name in names}
        if len(types) != 1:
            continue
        ggml_type = types.pop()
        if ggml_type not in KERNEL_TYPES or _row_values(module) % BLOCK_FORMATS[ggml_type][0]:
            continue
        kept.append(KeptQuantizedModule(name, module, ggml_type, names))
    return kept


def _quantized_parameter(rows: int, num_bytes: int, previous: nn.Parameter) -> nn.Parameter:
    parameter = nn.Parameter(torch.empty(rows, num_bytes, dtype=torch.uint8, device=previous.device),
                             requires_grad=False)
    loader = getattr(previous, "weight_loader", None)
    if loader is not None:
        parameter.weight_loader = loader
    return parameter


def convert_kept_modules(model: nn.Module, kept: Iterable[KeptQuantizedModule]) -> None:
    """Give every kept module a uint8 weight [rows, bytes per row] and the GGUF compute (before loading: the
    weight loaders then copy the checkpoint's block rows as they copy float rows). Tied LM heads share their
    embedding's new table."""
    embeddings = [module for module in model.modules()
                  if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead)]
    # Read before the tables change: which embedding each tied head shares its parameter with.
    tied = [(head, embedding) for head in model.modules() if isinstance(head, ParallelLMHead) and head.is_tied
            for embedding in embeddings if head.weight is embedding.weight]
    for entry in kept:
        module = entry.module
        num_values = _row_values(module)
        module.weight = _quantized_parameter(module.weight.shape[0], row_bytes(entry.ggml_type, num_values),
                                             module.weight)
        module.ggml_type = entry.ggml_type
        if isinstance(module, (LinearBase, ParallelLMHead)):
            module.linear_method = GGUF_LINEAR_METHOD
    for head, embedding in tied:
        if embedding.ggml_type is not None:
            head.tie_weights(embedding)
            head.ggml_type = embedding.ggml_type
            head.linear_method = GGUF_LINEAR_METHOD


def interleave_kept_modules(model: nn.Module) -> int:
    """Rearrange every loaded kept-quantized weight that `interleaves` into its interleaved layout, in place, and
    give the modules holding it (a tied head and its embedding share one) the layout's type id; returns how many
    weights changed."""
    holders: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        if getattr(module, "ggml_type", None) is not None:
            holders.setdefault(id(module.weight), []).append(module)
    num_interleaved = 0
    for modules in holders.values():
        weight, ggml_type = modules[0].weight, modules[0].ggml_type
        if not interleaves(ggml_type, weight.shape[0]):
            continue
        interleaved, interleaved_type = interleave_weight(weight.data, ggml_type)
        weight.data.copy_(interleaved)
        for module in modules:
            module.ggml_type = interleaved_type
        num_interleaved += 1
    if num_interleaved:
        logger.info("GGUF weights kept quantized: %d interleaved 16 rows at a time (the layout the kernels' byte "
                    "products read fastest here)", num_interleaved)
    return num_interleaved


def describe_kept(kept: list[KeptQuantizedModule], num_tensors: int) -> str:
    """One log line: how many modules and tensors keep their blocks, by type."""
    by_type: dict[str, int] = {}
    for entry in kept:
        by_type[KERNEL_TYPES[entry.ggml_type]] = by_type.get(KERNEL_TYPES[entry.ggml_type], 0) + 1
    kinds = ", ".join(f"{count} {name}" for name, count in sorted(by_type.items()))
    num_kept = sum(len(entry.checkpoint_names) for entry in kept)
    return (f"GGUF weights kept quantized: {len(kept)} modules ({kinds}) from {num_kept} of {num_tensors} tensors; "
            f"the rest dequantized")


__all__ = ["KeptQuantizedModule", "convert_kept_modules", "describe_kept", "interleave_kept_modules",
           "plan_kept_quantized"]
