"""GGUF weights kept quantized: linear layers, LM heads and embedding tables that hold their ggml blocks.

A GGUF file's Q4_1 matrix is 5 bits per value; dequantized to float32 at load it is 32. At batch 1 a decode step
reads every weight once, so its time is the bytes it reads: the embedded SmolLM2-135M Q4_1 file is 96 MB of
blocks and 540 MB of float32. Kept quantized, a layer's `weight` is a uint8 tensor [output rows, bytes per row]
holding the file's blocks along each row (rows are independent: fused layers stack their parts' rows, Q/K row
permutations and tensor-parallel row splits move whole rows), and `ggml_type` names the block layout.

Compute (`GGUFLinearMethod`, the linear seam of layers/linear.py):
- decode-sized batches (up to `KERNEL_MAX_ROWS` rows): the native kernel (kernels/cpu/gguf_linear.cpp). Every
  type quantizes x per 32-value block to int16 and takes exact int32 dot products with the weight's quants (a
  K-quant's per 32-value sub-block, Q6_K's 16-value scales folded into its quants; a product moves by at most sum
  over blocks of absmax(x) / 65534 * sum |w|) on the 'vector' unit (`gguf_linear_products()`; AVX2: one block at a
  time, a K super-block two sub-blocks at a time; AVX-512: four blocks or sub-blocks per vector, VPDPWSSD where
  the level has VNNI; up to 8 rows, 4 at AVX2, share each decoded block) and, for Q8_0, Q4_0, Q4_1 and Q4_K at
  the amx level, 'amx' (AMX-INT8 tiles: x's quants split in bytes, two tile products per 32-value block or
  sub-block, the weight decoded into B tiles once per call for every row), which the kernel takes from 5 rows (8 on
  the interleaved layouts, 9 for Q4_K). Within a unit a row's result does not depend on the other rows or the thread count (its
  float summation order depends on the unit and the ISA level);
- larger batches (prefill chunks): Q8_0, Q4_0, Q4_1 and Q4_K on the kernel's amx unit where it runs
  (`runs_on_kernel`); otherwise the weight is dequantized `DEQUANTIZE_TILE_VALUES` values of rows at a time (the
  same values, bitwise, as the file dequantized at load) and multiplied with F.linear.
Because the unit depends on the batch size, batch_invariant=True dequantizes GGUF weights at load (config/engine.py).
Embedding tables look up their rows the same way (`quantized_rows`).

Interleaved layouts (`interleave_weight`): where the kernels read them with vector instructions (`interleaves`:
every type at AVX2 and above), the loader rearranges a Q8_0 / Q4_0 / Q4_1 weight of a multiple of
16 rows 16 rows at a time (kernels/cpu/gguf_linear.h: one 64-byte vector holds 4 consecutive quants of each of 16
rows) and its `ggml_type` becomes the interleaved type id (`INTERLEAVED_TYPES`). The blocks are the same bytes in
another order; both product units read the layout with no transposes (the amx unit loads a Q8_0 group's quants as
its B tiles in place), and they give a row the same bits on it whatever the batch size.

The kernels need the native CPU library; without it (PAGEDSERVE_CPU_ISA=none, a CPU without a build) the loader
dequantizes at load instead (model_loader/gguf_quantized_load.py says so in the log).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_library import load_native_op
from pagedserve.layers.linear import LinearMethodBase

GGUF_LAYOUT = "gguf"
# ggml type ids the kernels read, by name (kernels/cpu/gguf_linear.h GgmlType).
KERNEL_TYPES: dict[int, str] = {8: "Q8_0", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 12: "Q4_K", 13: "Q5_K",
                                14: "Q6_K"}
# (values, bytes) per block of each kernel type.
BLOCK_FORMATS: dict[int, tuple[int, int]] = {8: (32, 34), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24),
                                             12: (256, 144), 13: (256, 176), 14: (256, 210)}
# Batches of up to this many rows take the kernel; larger ones dequantize tiles for F.linear (the vector products'
# rows reuse each decoded block only 8 (AVX2: 4) at a time, a GEMM reuses it across the whole batch), except where
# the amx unit runs a type of AMX_TYPES: its tiles reuse each decoded block across the whole batch too.
KERNEL_MAX_ROWS = 8
# The interleaved layouts: {type id: the ggml type whose blocks it holds} (kernels/cpu/gguf_linear.h).
INTERLEAVED_TYPE_OFFSET = 256
INTERLEAVED_TYPES: dict[int, int] = {ggml_type + INTERLEAVED_TYPE_OFFSET: ggml_type for ggml_type in (8, 2, 3)}
# Rows per group of an interleaved layout: its weights have a multiple of this many rows.
INTERLEAVED_ROWS = 16
# Q8_0, Q4_0, Q4_1 in either layout, and Q4_K: kernels/cpu/gguf_linear.cpp is_amx_type.
AMX_TYPES = frozenset({8, 2, 3, 12, *INTERLEAVED_TYPES})
# Values of the float32 tile a large batch dequantizes at once (16 MiB): bounds the memory a prefill chunk takes
# for a vocabulary-sized LM head.
DEQUANTIZE_TILE_VALUES = 1 << 22

_ops: dict[str, Any] | None = None


def gguf_kernels_available() -> bool:
    """Whether the native GGUF kernels are loaded (building the native library at first use)."""
    global _ops
    if _ops is None:
        linear = load_native_op("gguf_linear", "is_gguf_linear_supported", _gguf_linear_fake)
        if linear is None:
            _ops = {}
        else:
            # Shapes for torch.compile's tracing (the linear's is registered by load_native_op).
            torch.library.register_fake("pagedserve::gguf_dequantize")(
                lambda weight, ggml_type, k: weight.new_empty((weight.shape[0], k), dtype=torch.float32))
            torch.library.register_fake("pagedserve::gguf_embedding")(
                lambda weight, ggml_type, k, ids: weight.new_empty((*ids.shape, k), dtype=torch.float32))
            torch.library.register_fake("pagedserve::gguf_interleave")(
                lambda weight, ggml_type: torch.empty_like(weight))
            _ops = {"linear": linear, "dequantize": torch.ops.pagedserve.gguf_dequantize.default,
                    "embedding": torch.ops.pagedserve.gguf_embedding.default,
                    "interleave": torch.ops.pagedserve.gguf_interleave.default,
                    "products": tuple(torch.ops.pagedserve.gguf_linear_products()),
                    "fast_interleaved_types": frozenset(
                        ggml_type for ggml_type in INTERLEAVED_TYPES.values()
                        if torch.ops.pagedserve.gguf_interleaved_is_fast(ggml_type))}
    return bool(_ops)


def gguf_linear_products() -> tuple[str, ...]:
    """The integer-product units of this build and process, preferred first: 'amx' (AMX-INT8 tiles: Q8_0, Q4_0, Q4_1
    and Q4_K products of any batch) where it runs, then 'vector'; empty without the native kernels."""
    return _ops["products"] if gguf_kernels_available() else ()


def block_type(ggml_type: int) -> int:
    """The ggml type whose blocks `ggml_type` holds (itself, or the type an interleaved layout rearranges)."""
    return INTERLEAVED_TYPES.get(ggml_type, ggml_type)


def interleaves(ggml_type: int, num_rows: int) -> bool:
    """Whether a weight of `num_rows` rows of `ggml_type` blocks is interleaved at load: the kernels read the type's
    interleaved layout with vector instructions here (every type at AVX2 and above) and the rows fill
    whole groups."""
    return (gguf_kernels_available() and ggml_type in _ops["fast_interleaved_types"]
            and num_rows % INTERLEAVED_ROWS == 0)


def interleave_weight(weight: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, int]:
    """A [rows, bytes per row] weight of Q8_0 / Q4_0 / Q4_1 blocks in its interleaved layout (a new tensor of the
    same shape) and that layout's type id."""
    return _ops["interleave"](weight, ggml_type), ggml_type + INTERLEAVED_TYPE_OFFSET


def runs_on_kernel(num_rows: int, ggml_type: int) -> bool:
    """Whether a product of `num_rows` rows runs on the kernel (else on dequantized tiles and F.linear): decode-sized
    batches always; every batch of an integer-product type where the amx unit runs."""
    return num_rows <= KERNEL_MAX_ROWS or (ggml_type in AMX_TYPES and "amx" in gguf_linear_products())


def _gguf_linear_fake(x: torch.Tensor, weight: torch.Tensor, ggml_type: int, bias: torch.Tensor | None,
                      products: str = "auto") -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def row_bytes(ggml_type: int, num_values: int) -> int:
    """Bytes one row of `num_values` values takes in `ggml_type` blocks (ValueError when it is not whole blocks)."""
    values, num_bytes = BLOCK_FORMATS[block_type(ggml_type)]
    if num_values % values:
        raise ValueError(f"a {KERNEL_TYPES[block_type(ggml_type)]} row of {num_values} values is not a whole number "
                         f"of {values}-value blocks")
    return num_values // values * num_bytes


def dequantize_weight(weight: torch.Tensor, ggml_type: int, num_values: int) -> torch.Tensor:
    """The float32 [rows, num_values] values of a kept-quantized weight (ggml's reference values, bitwise)."""
    return _ops["dequantize"](weight, ggml_type, num_values)


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, ggml_type: int, num_values: int,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """x @ dequantize(weight)^T + bias for x [..., num_values] in any float dtype (computed in float32, returned in
    x's dtype)."""
    rows = x.reshape(-1, num_values)
    if rows.dtype != torch.float32:
        rows = rows.float()
    float_bias = None if bias is None else bias.float()
    if runs_on_kernel(rows.shape[0], ggml_type):
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        output = _ops["linear"](rows, weight, ggml_type, float_bias)
    else:
        tile_rows = max(1, DEQUANTIZE_TILE_VALUES // num_values)
        if ggml_type in INTERLEAVED_TYPES:  # slices keep whole row groups
            tile_rows = max(INTERLEAVED_ROWS, tile_rows // INTERLEAVED_ROWS * INTERLEAVED_ROWS)
        if weight.shape[0] <= tile_rows:
            output = F.linear(rows, dequantize_weight(weight, ggml_type, num_values), float_bias)
        else:
            output = torch.cat([
                F.linear(rows, dequantize_weight(weight[start:start + tile_rows], ggml_type, num_values),
                         None if float_bias is None else float_bias[start:start + tile_rows])
                for start in range(0, weight.shape[0], tile_rows)], dim=-1)
    output = output.reshape(*x.shape[:-1], weight.shape[0])
    return output if output.dtype == x.dtype else output.to(x.dtype)


def quantized_rows(weight: torch.Tensor, ggml_type: int, num_values: int, ids: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a kept-quantized table, shaped [*ids.shape, num_values], in `dtype` (an embedding lookup)."""
    rows = _ops["embedding"](weight, ggml_type, num_values, ids)
    return rows if dtype == torch.float32 else rows.to(dtype)


class GGUFLinearMethod(LinearMethodBase):
    """A linear layer (or LM head) whose `weight` holds ggml blocks of type `layer.ggml_type` over
    `layer.input_size_per_partition` values per row."""

    layout = GGUF_LAYOUT
    is_quantized = True  # layout transforms and restore_plain_layout leave the blocks alone

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return quantized_linear(x, layer.weight, layer.ggml_type, layer.input_size_per_partition, bias)


GGUF_LINEAR_METHOD = GGUFLinearMethod()


@dataclass(frozen=True)
class GGUFPart:
    """One checkpoint tensor inside a fused layer whose parts hold different ggml types (a Q4_K_M file's Q4_K q/k and
    Q6_K v): output rows [row_offset, row_offset + num_rows) of the layer, held as num_rows x row_bytes bytes from
    byte_offset of the layer's flat uint8 `weight`."""

    shard_id: object
    row_offset: int
    num_rows: int
    byte_offset: int
    row_bytes: int
    ggml_type: int

    def blocks(self, weight: torch.Tensor) -> torch.Tensor:
        """This part's [num_rows, row_bytes] blocks, a view of the layer's flat `weight`."""
        return weight[self.byte_offset:self.byte_offset + self.num_rows * self.row_bytes].view(
            self.num_rows, self.row_bytes)


class GGUFPartsLinearMethod(LinearMethodBase):
    """A fused linear layer whose parts keep blocks of different types (`layer.gguf_parts`, in output-row order): each
    part's product as GGUFLinearMethod computes it, concatenated along the output."""

    layout = GGUF_LAYOUT
    is_quantized = True

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        num_values = layer.input_size_per_partition
        return torch.cat([
            quantized_linear(x, part.blocks(layer.weight), part.ggml_type, num_values,
                             None if bias is None else bias[part.row_offset:part.row_offset + part.num_rows])
            for part in layer.gguf_parts], dim=-1)


GGUF_PARTS_LINEAR_METHOD = GGUFPartsLinearMethod()


__all__ = ["BLOCK_FORMATS", "DEQUANTIZE_TILE_VALUES", "GGUFLinearMethod", "GGUFPart", "GGUFPartsLinearMethod",
           "GGUF_LAYOUT", "GGUF_LINEAR_METHOD", "GGUF_PARTS_LINEAR_METHOD",
           "INTERLEAVED_ROWS", "INTERLEAVED_TYPES", "INTERLEAVED_TYPE_OFFSET", "KERNEL_MAX_ROWS", "KERNEL_TYPES",
           "AMX_TYPES", "block_type", "dequantize_weight", "gguf_kernels_available", "gguf_linear_products",
           "interleave_weight", "interleaves", "quantized_linear", "runs_on_kernel", "quantized_rows", "row_bytes"]
