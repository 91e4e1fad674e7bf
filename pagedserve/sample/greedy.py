"""first_argmax: the index of each row's first maximum, the sampler's greedy (and exponential-race) pick.

`tensor.max(dim=-1).indices` is what the sampler used, and stays the reference: it returns the first
index of the row's maximum, a NaN counting as larger than everything (so the first NaN wins). On the CPU
its index-tracking reduction is scalar, several times slower than the vectorised `amax` (measured
3.3 ms vs 0.8 ms for [64, 49152] float32 on one core), which makes greedy sampling a visible part of a
batch-64 decode step.

The fast form reduces in two levels with exactly the same result: the vocabulary is cut into blocks of
BLOCK_WIDTH columns; `amax` gives each block's maximum (NaN if the block holds one); `max(dim=-1)` over
those few block maxima picks the first block that holds the row's maximum (or its first NaN); a final
`max(dim=-1)` inside that block picks the first index there. The first maximum of the row lies in the first
block whose maximum equals the row's, and is that block's first maximum, so ties and NaN resolve as in the
reference. Small inputs keep the one-pass reference, where the extra ops would cost more than they save.

On the CPU, float32 and bfloat16 logits take the native kernel instead when the native library is built
(kernels/cpu/first_argmax.cpp: per row, a vectorised pass for the maximum and a second for its first index;
the same result, [64, 49152] bf16 in ~0.2 ms against ~1.2 ms for the two-level form on this machine).
"""
from __future__ import annotations

from typing import Any

import torch

from pagedserve.kernels.cpu_library import is_native_extension_available

# Columns per block: measured best among 512..4096 for vocabularies of 32k-152k (whole blocks stay in L1).
BLOCK_WIDTH = 1024
# Below this many logits the single max(dim=-1) is faster. Measured in the engine, where the logits were
# just written and the first pass over them pays for bringing them in: for a 49152 vocabulary on one core
# the one pass wins at 1-4 rows (170 vs 250 us at one row), the two passes from ~5 rows (16 rows: 0.63 vs
# 1.05 ms; 64 rows: 1.9 vs 3.9 ms). On warm data the two passes win from one row already.
MIN_TWO_LEVEL_ELEMENTS = 1 << 18


NATIVE_DTYPES = (torch.float32, torch.bfloat16)

# None: not looked up yet; False: the native library is not available; else the op's default overload.
_native_op: Any = None


def native_first_argmax_op() -> Any:
    """pagedserve::cpu_first_argmax when the native library is loaded (building it at first use), else None."""
    global _native_op
    if _native_op is None:
        _native_op = False
        if is_native_extension_available():
            torch.library.register_fake("pagedserve::cpu_first_argmax")(
                lambda logits: logits.new_empty((logits.shape[0],), dtype=torch.long))
            _native_op = torch.ops.pagedserve.cpu_first_argmax.default
    return _native_op or None


def reference_first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[num_rows, vocab] -> [num_rows] int64: the first index of each row's maximum (NaN is maximal)."""
    return logits.max(dim=-1).indices


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Same result as reference_first_argmax, bit for bit: the native kernel on the CPU, else two vectorised
    passes when that is faster."""
    if logits.device.type == "cpu" and logits.dtype in NATIVE_DTYPES and logits.stride(-1) == 1 \
            and not torch.compiler.is_compiling():
        op = native_first_argmax_op()
        if op is not None:
            return op(logits)
    return two_level_first_argmax(logits)


def two_level_first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """first_argmax in portable ops: blocks' amax, then the first block holding the maximum (module docstring)."""
    num_rows, vocab_size = logits.shape
    num_blocks = vocab_size // BLOCK_WIDTH
    if num_blocks < 2 or num_rows * vocab_size < MIN_TWO_LEVEL_ELEMENTS or logits.stride(-1) != 1:
        return reference_first_argmax(logits)
    head_width = num_blocks * BLOCK_WIDTH
    blocks = logits[:, :head_width].unflatten(1, (num_blocks, BLOCK_WIDTH))  # a view: columns are contiguous
    block_maxima = blocks.amax(dim=-1)  # [num_rows, num_blocks]; NaN where a block holds one
    has_tail = head_width < vocab_size
    if has_tail:
        # The last, partial block (vocab_size not a multiple of BLOCK_WIDTH) is block number num_blocks.
        tail = logits[:, head_width:]
        block_maxima = torch.cat([block_maxima, tail.amax(dim=-1, keepdim=True)], dim=1)
    best_block = block_maxima.max(dim=-1).indices  # the first block holding the row's maximum
    full_block = best_block.clamp(max=num_blocks - 1)
    chosen = blocks.gather(1, full_block[:, None, None].expand(-1, 1, BLOCK_WIDTH)).squeeze(1)
    index = full_block * BLOCK_WIDTH + chosen.max(dim=-1).indices
    if has_tail:
        index = torch.where(best_block == num_blocks, head_width + tail.max(dim=-1).indices, index)
    return index
