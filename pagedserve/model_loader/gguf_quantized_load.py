"""Which modules of a model built for a GGUF file keep the file's quantized blocks, and turning them into such
modules before the weights load (layers/gguf_linear.py computes with them).

A module keeps its blocks when every checkpoint tensor it loads (a fused layer's parts: q/k/v, gate/up) has a
ggml type the kernels read, it runs on the CPU on one tensor-parallel rank, and its rows are whole blocks. Anything
else (norms, float tensors) loads dequantized as before. A fused layer whose parts mix types (Q4_K_M files give
attn_v and ffn_down Q6_K in some layers, Q4_K elsewhere) keeps each part's blocks in its own byte range of one flat
uint8 weight (`GGUFPart`, GGUFPartsLinearMethod). A tied LM head shares its embedding's blocks. After loading,
`interleave_kept_modules` puts each kept weight (or part) in the interleaved layout its kernels read fastest, where
they have one (layers/gguf_linear.py).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
from torch import nn

from pagedserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.gguf_linear import (BLOCK_FORMATS, GGUF_LINEAR_METHOD, GGUF_PARTS_LINEAR_METHOD, KERNEL_TYPES,
                                           GGUFPart, interleave_weight, interleaves, row_bytes)
from pagedserve.layers.linear import (UNQUANTIZED_LINEAR_METHOD, LinearBase, MergedColumnParallelLinear,
                                      QKVParallelLinear)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeptQuantizedModule:
    """A module that will hold the blocks of the checkpoint tensors `checkpoint_names` (of types `part_types`, and
    shard ids `shard_ids` in a fused layer)."""

    name: str
    module: nn.Module
    checkpoint_names: tuple[str, ...]
    part_types: tuple[int, ...]
    shard_ids: tuple[object, ...]

    @property
    def ggml_type(self) -> int | None:
        """The one type of every part, or None where the parts mix types."""
        return self.part_types[0] if len(set(self.part_types)) == 1 else None


def _checkpoint_parts(model: nn.Module, module_name: str) -> tuple[tuple[str, object], ...]:
    """(HF tensor name, shard id) of each tensor a module's weight loads from: a fused layer's parts (the model's
    stacked_params_mapping), else its own name with no shard id."""
    parts = []
    for fused, checkpoint_name, shard_id in getattr(model, "stacked_params_mapping", ()):
        if module_name.endswith(f".{fused}"):
            parts.append((f"{module_name[:-len(fused)]}{checkpoint_name}.weight", shard_id))
    return tuple(parts) or ((f"{module_name}.weight", None),)


def _part_rows(module: nn.Module, shard_id: object) -> tuple[int, int]:
    """(first output row, rows) of a fused layer's part on its one rank."""
    if isinstance(module, QKVParallelLinear):
        offset, size, _, _ = module.shard_layout(shard_id)
        return offset, size
    sizes = module.output_sizes  # MergedColumnParallelLinear; tp_size is 1
    return sum(sizes[:shard_id]), sizes[shard_id]


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
        parts = _checkpoint_parts(model, name)
        types = tuple(tensor_types.get(checkpoint_name) for checkpoint_name, _ in parts)
        if any(ggml_type not in KERNEL_TYPES or _row_values(module) % BLOCK_FORMATS[ggml_type][0]
               for ggml_type in types):
            continue
        if len(set(types)) > 1 and not isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear)):
            continue
        kept.append(KeptQuantizedModule(name, module, tuple(checkpoint_name for checkpoint_name, _ in parts), types,
                                        tuple(shard_id for _, shard_id in parts)))
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
        if entry.ggml_type is None:
            _convert_to_parts(module, entry)
            continue
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


def _convert_to_parts(module: LinearBase, entry: KeptQuantizedModule) -> None:
    """A fused layer whose parts mix types: one flat uint8 weight holding each part's blocks in output-row order,
    loaded part by part (the checkpoint's shard ids pick the part)."""
    parts, num_bytes = [], 0
    for row_offset, num_rows, shard_id, ggml_type in sorted(
            (*_part_rows(module, shard_id), shard_id, ggml_type)
            for shard_id, ggml_type in zip(entry.shard_ids, entry.part_types)):
        part_bytes = row_bytes(ggml_type, module.input_size_per_partition)
        parts.append(GGUFPart(shard_id, row_offset, num_rows, num_bytes, part_bytes, ggml_type))
        num_bytes += num_rows * part_bytes
    module.weight = nn.Parameter(torch.empty(num_bytes, dtype=torch.uint8, device=module.weight.device),
                                 requires_grad=False)
    module.weight.weight_loader = _PartLoader(module.prefix or entry.name, {part.shard_id: part for part in parts})
    module.gguf_parts = tuple(parts)
    module.linear_method = GGUF_PARTS_LINEAR_METHOD


class _PartLoader:
    """The weight loader of a fused layer kept in parts: copies a checkpoint tensor's blocks into its part."""

    def __init__(self, prefix: str, parts: dict[object, GGUFPart]) -> None:
        self.prefix, self.parts = prefix, parts

    def __call__(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        part = self.parts.get(shard_id)
        if part is None:
            raise ValueError(f"{self.prefix}: shard_id={shard_id!r} is not one of this layer's GGUF parts "
                             f"{list(self.parts)}")
        destination = part.blocks(param.data)
        if tuple(loaded_weight.shape) != tuple(destination.shape) or loaded_weight.dtype != torch.uint8:
            raise ValueError(f"{self.prefix}: part {shard_id!r} holds uint8 blocks {tuple(destination.shape)}, the "
                             f"checkpoint gave {loaded_weight.dtype} {tuple(loaded_weight.shape)}")
        with torch.no_grad():
            destination.copy_(loaded_weight)


def interleave_kept_modules(model: nn.Module) -> int:
    """Rearrange every loaded kept-quantized weight that `interleaves` into its interleaved layout, in place, and
    give the modules holding it (a tied head and its embedding share one) the layout's type id; returns how many
    weights changed."""
    holders: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        if getattr(module, "ggml_type", None) is not None:
            holders.setdefault(id(module.weight), []).append(module)
    num_interleaved = 0
    for module in model.modules():
        parts = getattr(module, "gguf_parts", None)
        if parts is None:
            continue
        interleaved_parts = []
        for part in parts:
            if interleaves(part.ggml_type, part.num_rows):
                blocks = part.blocks(module.weight.data)
                interleaved, interleaved_type = interleave_weight(blocks, part.ggml_type)
                blocks.copy_(interleaved)
                part = replace(part, ggml_type=interleaved_type)
                num_interleaved += 1
            interleaved_parts.append(part)
        module.gguf_parts = tuple(interleaved_parts)
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
        kind = "+".join(KERNEL_TYPES[ggml_type] for ggml_type in sorted(set(entry.part_types)))
        by_type[kind] = by_type.get(kind, 0) + 1
    kinds = ", ".join(f"{count} {name}" for name, count in sorted(by_type.items()))
    num_kept = sum(len(entry.checkpoint_names) for entry in kept)
    return (f"GGUF weights kept quantized: {len(kept)} modules ({kinds}) from {num_kept} of {num_tensors} tensors; "
            f"the rest dequantized")


__all__ = ["KeptQuantizedModule", "convert_kept_modules", "describe_kept", "interleave_kept_modules",
           "plan_kept_quantized"]
