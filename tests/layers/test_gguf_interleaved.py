"""The interleaved GGUF layouts (kernels/cpu/gguf_linear.h, layers/gguf_linear.py interleave_weight): the same
Q8_0 / Q4_0 / Q4_1 blocks 16 rows at a time, and the products that read them.

Their claim is exact: every unit (the VNNI vector products, the amx unit, the scalar loop of builds without VNNI)
computes a row's output with the same integer dot products and the same float32 operations in the same order, so the
output is bitwise `bitwise_reference` below, at every ISA level (tests/kernels/test_isa_levels.py runs this module at
each level the machine has) and whatever the batch size, the unit or the thread count.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from native_marks import NEEDS_GGUF_KERNELS
from pagedserve.layers import gguf_linear
from pagedserve.layers.gguf_linear import (BLOCK_FORMATS, INTERLEAVED_ROWS, INTERLEAVED_TYPES, block_type,
                                           dequantize_weight, gguf_linear_products, interleave_weight, interleaves,
                                           quantized_linear, quantized_rows)
from test_gguf_linear import blocks_of, integer_blocks, product_unit, reference_values

pytestmark = NEEDS_GGUF_KERNELS

TYPE_NAMES = ("Q8_0", "Q4_0", "Q4_1")
UNITS = ("amx", "vector")


def interleaved(type_name: str, rows: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(row-layout blocks, the same interleaved, the interleaved type id)."""
    blocks = blocks_of(type_name, rows, k, seed)
    weight, ggml_type = interleave_weight(blocks, GGMLQuantizationType[type_name].value)
    return blocks, weight, ggml_type


def fused_multiply_add(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 fma(a, b, c): the float32 product is exact in float64, the sum rounds once there (a second rounding
    to float32 differs from one only on ties the inputs here do not make)."""
    return (a.double() * b.double() + c.double()).float()


def bitwise_reference(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The interleaved products' float32 arithmetic in torch: x quantized per 32-value block as the kernel does
    (d = absmax / 32767, q = round-half-even(x * (1 / d)), s = d * float(sum q)); per block in order
    acc = fma(float(dot), d_w * d_x, acc) with dot the exact sum(q_w q_x) (Q4_0: q_w - 8), then Q4_1's
    acc = fma(m_w, s_x, acc); then acc + bias. `blocks` in the row layout."""
    num_rows, k = x.shape
    x_blocks = x.float().reshape(num_rows, -1, 32)
    d_x = x_blocks.abs().amax(-1) / 32767
    inverse = torch.where(d_x != 0, 1 / d_x, torch.zeros_like(d_x))
    q_x = torch.round(x_blocks * inverse.unsqueeze(-1)).to(torch.int64)  # [M, B, 32]
    s_x = d_x * q_x.sum(-1).float()
    raw = blocks.numpy().reshape(blocks.shape[0], -1, BLOCK_FORMATS[ggml_type][1])
    d_w = torch.from_numpy(np.ascontiguousarray(raw[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32))
    m_w = torch.from_numpy(np.ascontiguousarray(raw[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32))
    if ggml_type == GGMLQuantizationType.Q8_0.value:
        q_w = torch.from_numpy(np.ascontiguousarray(raw[:, :, 2:34]).view(np.int8).astype(np.int64))
    else:
        packed = raw[:, :, 4:20] if ggml_type == GGMLQuantizationType.Q4_1.value else raw[:, :, 2:18]
        q_w = torch.from_numpy(np.concatenate((packed & 0x0F, packed >> 4), axis=-1).astype(np.int64))
        if ggml_type == GGMLQuantizationType.Q4_0.value:
            q_w = q_w - 8
    acc = torch.zeros(num_rows, blocks.shape[0])
    for block in range(k // 32):
        dot = (q_x[:, block] @ q_w[:, block].T).float()  # exact int64, then float32 (round to nearest even)
        acc = fused_multiply_add(dot, d_w[:, block].unsqueeze(0) * d_x[:, block].unsqueeze(1), acc)
        if ggml_type == GGMLQuantizationType.Q4_1.value:
            acc = fused_multiply_add(m_w[:, block].unsqueeze(0), s_x[:, block].unsqueeze(1), acc)
    return acc + (bias if bias is not None else torch.zeros(blocks.shape[0]))


@pytest.mark.parametrize("type_name", TYPE_NAMES)
def test_the_layout_holds_the_same_blocks(type_name: str) -> None:
    """Dequantized and looked up row by row, the interleaved weight gives the row layout's values bitwise; each group
    of 16 rows holds the same bytes, rearranged; the type id names the blocks it holds."""
    k, rows = 576, 48
    blocks, weight, ggml_type = interleaved(type_name, rows, k)
    base = GGMLQuantizationType[type_name].value
    assert INTERLEAVED_TYPES[ggml_type] == base == block_type(ggml_type) and block_type(base) == base
    assert weight.shape == blocks.shape and weight.dtype == torch.uint8 and not torch.equal(weight, blocks)
    reference = reference_values(blocks, base, k)
    assert torch.equal(dequantize_weight(weight, ggml_type, k).view(torch.int32), reference.view(torch.int32))
    ids = torch.tensor([[0, 17], [47, 16]])
    assert torch.equal(quantized_rows(weight, ggml_type, k, ids, torch.float32), reference[ids])
    group_bytes = INTERLEAVED_ROWS * blocks.shape[1]
    for group in range(rows // INTERLEAVED_ROWS):
        span = slice(group * group_bytes, (group + 1) * group_bytes)
        assert torch.equal(weight.reshape(-1)[span].sort().values, blocks.reshape(-1)[span].sort().values)


@pytest.mark.parametrize("unit", UNITS)
@pytest.mark.parametrize("type_name", TYPE_NAMES)
@pytest.mark.parametrize("num_rows", [1, 3, 4, 5, 17])  # the vector products' passes of 4 rows and a short one
@pytest.mark.parametrize("k", [32, 96, 1120])
def test_products_are_bitwise_the_reference_arithmetic(unit: str, type_name: str, num_rows: int, k: int) -> None:
    blocks, weight, ggml_type = interleaved(type_name, 32, k, seed=num_rows)
    x = torch.randn(num_rows, k, generator=torch.Generator().manual_seed(k + num_rows)) * 3
    x[0, :32] = 0  # an all-zero block: d = 0
    bias = torch.randn(32)
    base = GGMLQuantizationType[type_name].value
    for b in (None, bias):
        output = torch.ops.pagedserve.gguf_linear(x, weight, ggml_type, b, product_unit(unit))
        assert torch.equal(output, bitwise_reference(x, blocks, base, b))


@pytest.mark.parametrize("unit", UNITS)
@pytest.mark.parametrize("type_name", TYPE_NAMES)
def test_integer_sums_are_exact(unit: str, type_name: str) -> None:
    """Scales of 1, x integers whose block absmax is 32767 (x's quants are x), weights spanning their whole range
    (Q8_0: -128 .. 127, the high bytes' unsigned offset at its extremes): the product is the int64 product."""
    rng = np.random.default_rng(5)
    k, n, num_rows = 96, 32, 6
    x = rng.integers(-100, 101, size=(num_rows, k // 32, 32))
    x[:, :, 0] = rng.choice([-32767, 32767], size=(num_rows, k // 32))
    if type_name == "Q8_0":
        quants, offset = rng.integers(-128, 128, size=(n, k)), 0
    else:
        quants, offset = rng.integers(0, 16, size=(n, k)), (-8 if type_name == "Q4_0" else 0)
    quants.reshape(n, -1, 32)[:, :, 0] = 0 if type_name != "Q4_0" else 8  # the 32767s meet a zero weight
    blocks = integer_blocks(type_name, quants, 1.0)
    weight, ggml_type = interleave_weight(blocks, GGMLQuantizationType[type_name].value)
    expected = torch.from_numpy(x.reshape(num_rows, k)) @ torch.from_numpy(quants + offset).T
    assert int(expected.abs().max()) < 2 ** 24
    output = torch.ops.pagedserve.gguf_linear(torch.from_numpy(x.reshape(num_rows, k)).float(), weight, ggml_type,
                                              None, product_unit(unit))
    assert torch.equal(output, expected.float())


@pytest.mark.parametrize("type_name", TYPE_NAMES)
def test_a_row_has_the_same_bits_alone_in_any_batch_on_any_unit_and_thread_count(type_name: str) -> None:
    """What the row layout cannot claim ('auto' picks a unit by batch size, and the units sum differently): on the
    interleaved layout a row is the same bits alone, in a batch of 20, on either unit and on one thread."""
    blocks, weight, ggml_type = interleaved(type_name, 64, 576)
    x = torch.randn(20, 576)
    batch = torch.ops.pagedserve.gguf_linear(x, weight, ggml_type, None, "auto")
    units = [unit for unit in UNITS if unit in gguf_linear_products()]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for unit in units:
            assert torch.equal(torch.ops.pagedserve.gguf_linear(x, weight, ggml_type, None, unit), batch)
        for row in range(x.shape[0]):
            for unit in units:
                alone = torch.ops.pagedserve.gguf_linear(x[row:row + 1], weight, ggml_type, None, unit)
                assert torch.equal(alone, batch[row:row + 1])
    finally:
        torch.set_num_threads(threads)


def test_large_batches_without_the_amx_unit_dequantize_whole_row_groups(monkeypatch) -> None:
    """Without the amx unit a prefill-sized batch dequantizes tiles of rows: on an interleaved weight the tiles keep
    whole groups of 16 rows (a tile of 20 rows' values would split one)."""
    monkeypatch.setitem(gguf_linear._ops, "products", ("vector",))
    k = 64
    blocks, weight, ggml_type = interleaved("Q4_1", 48, k)
    monkeypatch.setattr(gguf_linear, "DEQUANTIZE_TILE_VALUES", 20 * k)
    x = torch.randn(40, k)
    expected = x @ reference_values(blocks, GGMLQuantizationType.Q4_1.value, k).T
    torch.testing.assert_close(quantized_linear(x, weight, ggml_type, k, None), expected, rtol=1e-5, atol=1e-5)


def test_only_whole_groups_of_the_integer_types_interleave() -> None:
    op = torch.ops.pagedserve
    with pytest.raises(RuntimeError, match="N=20 rows is not a multiple of 16"):
        op.gguf_interleave(blocks_of("Q4_1", 20, 64), 3)
    with pytest.raises(RuntimeError, match=r"Q8_0 \(8\), Q4_0 \(2\) or Q4_1 \(3\) blocks expected, got ggml type 7"):
        op.gguf_interleave(blocks_of("Q5_1", 16, 64), 7)
    with pytest.raises(RuntimeError, match="an interleaved weight .type 259. has a multiple of 16 rows, got 20"):
        op.gguf_linear(torch.randn(1, 64), blocks_of("Q4_1", 20, 64), 259, None)
    assert not interleaves(3, 20) and not interleaves(7, 32)
    for ggml_type in (8, 2, 3):
        assert interleaves(ggml_type, 32) == bool(op.gguf_interleaved_is_fast(ggml_type))
