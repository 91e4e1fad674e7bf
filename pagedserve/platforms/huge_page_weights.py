"""A loaded model's weights moved into one arena on transparent huge pages (the CPU's weights).

A batch-1 decode step streams every weight once, so its speed is the speed at which the weights' memory reads.
Loading leaves the weights in many separate allocations on 4 KiB pages: each 4 KiB costs a TLB entry, and in a VM a
TLB miss walks two page tables. Copied into one 2 MiB-aligned anonymous mapping advised MADV_HUGEPAGE
(platforms/huge_page_memory.py), they are mapped 2 MiB per TLB entry. Measured on the AMD EPYC VM (2 vCPUs,
SmolLM2-135M-shaped benchmark model in bfloat16):
- the LM head's memory read in place: 33-35 GB/s against 25-28 (one process: 42);
- the bf16 dot unit over the same packed head, same buffers: 33.4 against 30.8 GB/s;
- batch-1 decode, four pairs of processes with huge_page_weights on and off: 126.1 / 94.3 / 96.4 / 98.4 against
  96.2 / 93.5 / 94.6 / 92.8 tok/s (1.31 / 1.01 / 1.02 / 1.06x).
The move costs 0.25-0.55 s at start for those 312 MiB, most of it the first touch of the huge pages (the kernel
faults and zeroes them: 74-428 ms for 312 MiB on that VM, against ~65 ms on small pages); the copy itself ~20 ms.

`move_weights_to_huge_pages` re-points every tensor the model's modules hold (parameters, buffers and tensor
attributes such as packed weights) whose storage holds at least `MIN_STORAGE_BYTES`: each such storage is copied,
bit for bit, to its own 4 KiB-aligned place in the arena, and every tensor viewing it is set to the same view of the
copy (same offset, sizes and strides), so tied weights stay tied and nothing a module computes changes. The old
storages are freed as their last view moves. Opaque tensors (oneDNN's packed layout), tensors off the CPU and
small storages (norm weights, biases) stay where they are. Sharing is kept per storage: two distinct storages that
alias one buffer (say, two `torch.frombuffer` views of one mapping) become two copies, which matters only to code
that writes through one and reads through the other.

Call it after loading and the weight layout transform, before anything records the weights' addresses (the
native decode stack's plan holds the tensor objects, which keep their identity).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.platforms.huge_page_memory import allocate_huge_page_bytes

logger = logging.getLogger(__name__)

# Storages below this stay where they are: a few KiB of norm weights are not worth a 4 KiB slot each.
MIN_STORAGE_BYTES = 64 << 10
# Every storage starts on a page of its own: a weight's first rows do not share a page with another's last.
STORAGE_ALIGNMENT_BYTES = 4096


@dataclass(frozen=True)
class HugePageWeights:
    """What `move_weights_to_huge_pages` did: the storages it moved, their bytes, the tensors re-pointed, and
    the arena (None when nothing qualified); `is_advised` is False where the kernel refused MADV_HUGEPAGE
    (the arena is then one mapping of small pages)."""

    num_storages: int
    num_bytes: int
    num_tensors: int
    arena: torch.Tensor | None
    is_advised: bool


def _model_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor the modules hold, once each: parameters, buffers and tensor attributes."""
    tensors: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for value in (*module._parameters.values(), *module._buffers.values(), *vars(module).values()):
            if isinstance(value, torch.Tensor):
                tensors.setdefault(id(value), value)
    return list(tensors.values())


def _is_movable(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.layout == torch.strided and not tensor.is_mkldnn \
        and not tensor.is_quantized and tensor.untyped_storage().nbytes() >= MIN_STORAGE_BYTES


def move_weights_to_huge_pages(model: nn.Module) -> HugePageWeights:
    """Move the model's large weight storages into one arena on huge pages (see the module docstring)."""
    start_time = time.perf_counter()
    # Storage address -> the storage and the tensors viewing it (a storage held by several tensors moves once).
    groups: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for tensor in _model_tensors(model):
        if _is_movable(tensor):
            storage = tensor.untyped_storage()
            groups.setdefault(storage.data_ptr(), (storage, []))[1].append(tensor)
    if not groups:
        return HugePageWeights(0, 0, 0, None, False)
    sizes = [-(-storage.nbytes() // STORAGE_ALIGNMENT_BYTES) * STORAGE_ALIGNMENT_BYTES
             for storage, _ in groups.values()]
    total = sum(sizes)
    num_storages = len(groups)
    arena, is_advised = allocate_huge_page_bytes(total)
    arena_storage = arena.untyped_storage()
    # The arena tensor starts `base` bytes into its mapping's storage (the 2 MiB alignment).
    base = arena.data_ptr() - arena_storage.data_ptr()
    start = num_tensors = 0
    with torch.no_grad():
        for size in sizes:
            # Popped so that the old storage goes back once its last view has moved, not at the end.
            storage, views = groups.pop(next(iter(groups)))
            arena[start:start + storage.nbytes()].copy_(_bytes_of(storage))
            for tensor in views:
                element_size = tensor.element_size()
                assert (base + start) % element_size == 0
                tensor.set_(arena_storage, (base + start) // element_size + tensor.storage_offset(),
                            tensor.size(), tensor.stride())
                num_tensors += 1
            del storage, views
            start += size
    logger.info("weights on huge pages: %d storages (%.1f MiB, %d tensors) moved into one 2 MiB-aligned "
                "arena in %.2f s%s", num_storages, total / 2**20, num_tensors, time.perf_counter() - start_time,
                "" if is_advised else " (MADV_HUGEPAGE refused: small pages)")
    return HugePageWeights(num_storages, total, num_tensors, arena, is_advised)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 view of a whole storage."""
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


__all__ = ["HugePageWeights", "MIN_STORAGE_BYTES", "move_weights_to_huge_pages"]
