"""The GGUF kernels (kernels/cpu/gguf_linear.cpp) against their references, for every type the kernels read, on
synthetic blocks and on every tensor of the SmolLM2 file:
- dequantization bitwise equal to ggml's reference decoders (model_loader/gguf_dequant.py);
- products of every type (x quantized to int16 per 32-value block, integer dot products per
  32-value block or K sub-block) equal to an exact integer reference of that arithmetic (the K types' sub-block
  quants, scales and mins decoded with gguf-py's own code) within float32 rounding, and within the activation
  quantization's bound,
  sum over blocks of absmax(x) / 65534 * sum |w|, of the float64 product on the dequantized weight; and bitwise
  equal to an int64 reference where every value, scale and partial sum is an integer float32 holds exactly (the
  integer sums are exact whatever the ISA level's lane layout or summation order).
Every test runs once more at each other ISA level the machine has (tests/kernels/test_isa_levels.py): the AVX2 and
AVX-512 kernels lay blocks out in lanes differently and must each pass."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFReader, quants

from native_marks import NEEDS_GGUF_KERNELS
from pagedserve.layers import gguf_linear
from pagedserve.layers.gguf_linear import (BLOCK_FORMATS, KERNEL_MAX_ROWS, KERNEL_TYPES, dequantize_weight,
                                           gguf_linear_products, quantized_linear, quantized_rows, runs_on_kernel)
from pagedserve.model_loader.default_model import resolve_model_path
from pagedserve.model_loader.gguf_dequant import dequantize

pytestmark = NEEDS_GGUF_KERNELS

# Types gguf-py quantizes (real blocks); the K types are random payload bytes with sane float16 scales.
QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# A product's error bound relative to sum(|x| |w|): float32 accumulation over K <= 4096 values in 8 lanes.
RELATIVE_TOLERANCE = 1e-5
# The types whose products quantize x to int16 (kernels/cpu/gguf_linear.cpp is_integer_product_type and
# is_k_quant_type).
K_QUANT_TYPES = {GGMLQuantizationType.Q4_K.value, GGMLQuantizationType.Q5_K.value, GGMLQuantizationType.Q6_K.value}
INTEGER_PRODUCT_TYPES = {GGMLQuantizationType.Q8_0.value, GGMLQuantizationType.Q4_0.value,
                         GGMLQuantizationType.Q4_1.value, GGMLQuantizationType.Q5_0.value,
                         GGMLQuantizationType.Q5_1.value, *K_QUANT_TYPES}


# The integer-product units (kernels/cpu/gguf_linear.cpp): 'amx' runs at the amx level only.
PRODUCT_UNITS = ("amx", "vector")


def product_unit(name: str) -> str:
    """`name` where this build and process run it; skips the test otherwise (the amx unit is still tested at the
    amx level on machines that have AMX-INT8)."""
    if name not in gguf_linear_products():
        pytest.skip(f"the '{name}' GGUF product unit needs the amx ISA level (AMX-INT8, Linux granting the tile "
                    f"state); this process runs {list(gguf_linear_products())}")
    return name


def blocks_of(type_name: str, rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [rows, bytes per row] of `type_name` blocks."""
    ggml_type = GGMLQuantizationType[type_name]
    rng = np.random.default_rng(seed + ggml_type.value)
    if type_name in QUANTIZABLE:
        values = (rng.standard_normal((rows, k)) * rng.uniform(0.05, 3)).astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(quants.quantize(values, ggml_type)).view(np.uint8).reshape(rows, -1))
    values_per_block, bytes_per_block = BLOCK_FORMATS[ggml_type.value]
    raw = rng.integers(0, 256, size=(rows * k // values_per_block, bytes_per_block), dtype=np.uint8)
    for offset in SCALE_OFFSETS[type_name]:
        raw[:, offset:offset + 2] = rng.uniform(-0.05, 0.05, size=(len(raw), 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def reference_values(blocks: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks.numpy(), ggml_type, (blocks.shape[0], k)))


def assert_close_to_float64(output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None, ggml_type: int | None = None) -> None:
    """`output` within float32 rounding of x @ weight^T + bias in float64, plus for the integer-product types the
    bound of quantizing x to int16 per 32-value block."""
    expected = x.double() @ weight.double().T
    bound = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        expected += bias.double()
        bound += bias.double().abs()
    allowed = RELATIVE_TOLERANCE * bound + 1e-30
    if ggml_type in INTEGER_PRODUCT_TYPES:
        x_absmax = x.double().reshape(x.shape[0], -1, 32).abs().amax(-1)  # [M, blocks]
        weight_sums = weight.double().abs().reshape(weight.shape[0], -1, 32).sum(-1)  # [N, blocks]
        allowed = allowed + (x_absmax / 65534) @ weight_sums.T
    error = (output.double() - expected).abs()
    assert bool((error <= allowed).all()), float((error / allowed).max())


def k_quant_parts(blocks: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A K-quant weight [N, bytes per row] as 32-value sub-blocks: int64 quants q [N, B, 32], float32 scales and
    offsets [N, B] with values = scale * q + offset (Q4_K / Q5_K: the quants, d * sc and -(dmin * m); Q6_K: the 6-bit
    quants minus 32 times their 16-value half's int8 scale, d and 0), unpacked as gguf-py's dequantize_blocks does."""
    num_rows = blocks.shape[0]
    raw = blocks.numpy().reshape(-1, BLOCK_FORMATS[ggml_type][1])
    if ggml_type == GGMLQuantizationType.Q6_K.value:
        ql, qh, scales, d = np.hsplit(raw, [128, 192, 208])
        ql = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        qh = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 0x03
        q = (ql.reshape(-1, 2, 4, 32) | (qh.reshape(-1, 2, 4, 32) << 4)).astype(np.int64) - 32  # [blocks, 256]
        q = q.reshape(-1, 16, 16) * scales.view(np.int8).astype(np.int64).reshape(-1, 16, 1)
        scale = np.repeat(d.view(np.float16).astype(np.float32), 8, axis=1)
        offset = np.zeros_like(scale)
    else:
        d, dmin, packed, rest = np.hsplit(raw, [2, 4, 16])
        sc, m = quants.Q4_K.get_scale_min(packed)
        if ggml_type == GGMLQuantizationType.Q5_K.value:
            qh, qs = np.hsplit(rest, [32])
            high = (qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        else:
            qs, high = rest, 0
        low = (qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        q = low.reshape(-1, 8, 32).astype(np.int64) + 16 * np.asarray(high, np.int64)
        scale = d.view(np.float16).astype(np.float32) * sc.astype(np.float32)
        offset = -(dmin.view(np.float16).astype(np.float32) * m.astype(np.float32))
    return (torch.from_numpy(q.reshape(num_rows, -1, 32)), torch.from_numpy(scale.reshape(num_rows, -1)),
            torch.from_numpy(offset.reshape(num_rows, -1)))


def integer_product_reference(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The integer-product arithmetic in float64 with exact integer dot products: x quantized per 32-value block as the
    kernel does (d = absmax / 32767 in float32, q = round-half-even(x * (1 / d))), then per block
    d_w d_x sum(q_w q_x) (+ m_w d_x sum(q_x) for Q4_1 / Q5_1, - 8 (16) d_w d_x sum(q_x) for Q4_0 (Q5_0); for a K sub-block
    scale d_x sum(q_w q_x) + offset d_x sum(q_x))."""
    num_rows, k = x.shape
    x_blocks = x.float().reshape(num_rows, -1, 32)
    d_x = x_blocks.abs().amax(-1) / 32767
    inverse = torch.where(d_x != 0, 1 / d_x, torch.zeros_like(d_x))
    q_x = torch.round(x_blocks * inverse.unsqueeze(-1)).to(torch.int64)  # [M, B, 32]
    s_x = (d_x * q_x.sum(-1).float()).double()  # d * sum(q), in float32 as the kernel
    if ggml_type in K_QUANT_TYPES:
        q_w, scale_w, offset_w = k_quant_parts(blocks, ggml_type)
        dots = torch.einsum("mbi,nbi->mnb", q_x, q_w).double()
        scale = (scale_w.unsqueeze(0) * d_x.unsqueeze(1)).double()  # in float32, as the kernel
        return (scale * dots).sum(-1) + (offset_w.double().unsqueeze(0) * s_x.unsqueeze(1)).sum(-1)
    raw = blocks.numpy().reshape(blocks.shape[0], -1, BLOCK_FORMATS[ggml_type][1])
    d_w = torch.from_numpy(np.ascontiguousarray(raw[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float64))
    name = GGMLQuantizationType(ggml_type).name
    if ggml_type == GGMLQuantizationType.Q8_0.value:
        q_w = torch.from_numpy(np.ascontiguousarray(raw[:, :, 2:34]).view(np.int8).astype(np.int64))
    else:
        nibbles_at = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[name]
        packed = raw[:, :, nibbles_at:nibbles_at + 16]
        q_w = torch.from_numpy(np.concatenate((packed & 0x0F, packed >> 4), axis=-1).astype(np.int64))
        if name.startswith("Q5"):  # the fifth bits: bit i of the little-endian 32 bits before the nibbles, value i
            bits = np.ascontiguousarray(raw[:, :, nibbles_at - 4:nibbles_at]).view("<u4")[..., 0].astype(np.int64)
            q_w += torch.from_numpy(((bits[..., None] >> np.arange(32)) & 1) << 4)
    dots = torch.einsum("mbi,nbi->mnb", q_x, q_w).double()  # exact integers
    scale = (d_w.float().unsqueeze(0) * d_x.unsqueeze(1)).double()  # d_w d_x in float32, as the kernel
    result = (scale * dots).sum(-1)
    if name in ("Q4_1", "Q5_1"):
        m_w = torch.from_numpy(np.ascontiguousarray(raw[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float64))
        result += (m_w.unsqueeze(0) * s_x.unsqueeze(1)).sum(-1)
    elif name in ("Q4_0", "Q5_0"):
        result -= ((8 if name == "Q4_0" else 16) * d_w.unsqueeze(0) * s_x.unsqueeze(1)).sum(-1)
    return result


def test_kernel_types_are_the_loaders_quantized_types() -> None:
    assert set(KERNEL_TYPES.values()) == set(QUANTIZABLE) | set(SCALE_OFFSETS)
    for ggml_type, (values, num_bytes) in BLOCK_FORMATS.items():
        assert GGMLQuantizationType(ggml_type).name == KERNEL_TYPES[ggml_type]
        from gguf import GGML_QUANT_SIZES
        assert GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)] == (values, num_bytes)


@pytest.mark.parametrize("type_name", list(KERNEL_TYPES.values()))
def test_dequantize_and_rows_bitwise_the_reference(type_name: str) -> None:
    ggml_type = GGMLQuantizationType[type_name].value
    k = 512
    blocks = blocks_of(type_name, 24, k)
    reference = reference_values(blocks, ggml_type, k)
    assert torch.equal(dequantize_weight(blocks, ggml_type, k).view(torch.int32), reference.view(torch.int32))
    ids = torch.tensor([[3, 0], [23, 3]])
    rows = quantized_rows(blocks, ggml_type, k, ids, torch.float32)
    assert rows.shape == (2, 2, k) and torch.equal(rows, reference[ids])
    assert torch.equal(quantized_rows(blocks, ggml_type, k, ids, torch.bfloat16), reference[ids].bfloat16())


@pytest.mark.parametrize("type_name", list(KERNEL_TYPES.values()))
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 8, 9, 40])
def test_product_matches_float64_on_the_dequantized_weight(type_name: str, num_rows: int) -> None:
    ggml_type = GGMLQuantizationType[type_name].value
    k, n = 768, 37  # n not a multiple of the kernel's four-row units
    blocks = blocks_of(type_name, n, k, seed=num_rows)
    weight = reference_values(blocks, ggml_type, k)
    x = torch.randn(num_rows, k, generator=torch.Generator().manual_seed(num_rows))
    bias = torch.randn(n)
    product_type = ggml_type if runs_on_kernel(num_rows, ggml_type) else None  # else: dequantized tiles
    assert_close_to_float64(quantized_linear(x, blocks, ggml_type, k, None), x, weight, ggml_type=product_type)
    assert_close_to_float64(quantized_linear(x, blocks, ggml_type, k, bias), x, weight, bias, ggml_type=product_type)


# The amx unit takes Q8_0, Q4_0 and Q4_1; the vector unit every 32-value type.
UNITS_AND_TYPES = [(unit, type_name) for unit in PRODUCT_UNITS for type_name in ("Q8_0", "Q4_0", "Q4_1")] + [
    ("vector", "Q5_0"), ("vector", "Q5_1")]


@pytest.mark.parametrize("unit, type_name", UNITS_AND_TYPES)
@pytest.mark.parametrize("num_rows", [1, 3, 6, 8, 17, 64])  # amx: one short tile, whole tiles of 16 and a short one
@pytest.mark.parametrize("k", [32, 96, 1024, 1120])  # 1, 3, 32 and 35 blocks: the AVX-512 kernel's four-block groups
def test_integer_products_equal_the_exact_integer_reference(unit: str, type_name: str, num_rows: int, k: int) -> None:
    ggml_type = GGMLQuantizationType[type_name].value
    n = 21  # amx: one 16-column unit and a short one
    blocks = blocks_of(type_name, n, k, seed=7 * num_rows)
    x = torch.randn(num_rows, k, generator=torch.Generator().manual_seed(num_rows)) * 3
    x[0, :32] = 0  # an all-zero block: d = 0
    output = torch.ops.pagedserve.gguf_linear(x, blocks, ggml_type, None, product_unit(unit))
    expected = integer_product_reference(x, blocks, ggml_type)
    scale = x.double().abs() @ reference_values(blocks, ggml_type, k).double().abs().T
    assert bool(((output.double() - expected).abs() <= 1e-5 * scale).all())


# The amx unit takes Q4_K (decode_k_quant_tiles); every K-quant runs on the vector unit.
K_QUANT_UNITS_AND_TYPES = [("vector", "Q4_K"), ("vector", "Q5_K"), ("vector", "Q6_K"), ("amx", "Q4_K")]


@pytest.mark.parametrize("unit, type_name", K_QUANT_UNITS_AND_TYPES)
@pytest.mark.parametrize("num_rows", [1, 3, 8, 17, 64])
@pytest.mark.parametrize("k", [256, 1280])
def test_k_quant_products_equal_the_exact_integer_reference(unit: str, type_name: str, num_rows: int, k: int) -> None:
    ggml_type = GGMLQuantizationType[type_name].value
    n = 21  # five four-row units and a short one
    blocks = blocks_of(type_name, n, k, seed=7 * num_rows)
    weight = reference_values(blocks, ggml_type, k)
    q_w, scale_w, offset_w = k_quant_parts(blocks, ggml_type)
    parts = (scale_w.unsqueeze(-1) * q_w.float() + offset_w.unsqueeze(-1)).reshape(n, k)
    if type_name == "Q6_K":  # the reference rounds (d * sc) * q, the parts d * (sc * q)
        torch.testing.assert_close(parts, weight, rtol=1e-6, atol=0)
    else:
        assert torch.equal(parts, weight)
    x = torch.randn(num_rows, k, generator=torch.Generator().manual_seed(num_rows)) * 3
    x[0, :32] = 0  # an all-zero block: d = 0
    output = torch.ops.pagedserve.gguf_linear(x, blocks, ggml_type, None, product_unit(unit))
    expected = integer_product_reference(x, blocks, ggml_type)
    scale = x.double().abs() @ weight.double().abs().T
    assert bool(((output.double() - expected).abs() <= 1e-5 * scale).all())
    assert_close_to_float64(output, x, weight, ggml_type=ggml_type)


def integer_blocks(type_name: str, quants: np.ndarray, d: float, m: float = 0.0) -> torch.Tensor:
    """uint8 [rows, bytes per row] of `type_name` blocks holding `quants` [rows, K] (int8 for Q8_0, 0 .. 15 for the
    Q4 types) with scale d (and Q4_1's m) in every block."""
    rows, k = quants.shape
    blocks = quants.reshape(rows, k // 32, 32)
    d_bytes = np.broadcast_to(np.array([d], np.float16).view(np.uint8), (rows, k // 32, 2))
    if type_name == "Q8_0":
        payload = blocks.astype(np.int8).view(np.uint8)
        header = d_bytes
    else:
        payload = (blocks[..., :16] | (blocks[..., 16:] << 4)).astype(np.uint8)
        header = d_bytes
        if type_name == "Q4_1":
            header = np.concatenate((d_bytes, np.broadcast_to(np.array([m], np.float16).view(np.uint8),
                                                              (rows, k // 32, 2))), axis=-1)
    return torch.from_numpy(np.ascontiguousarray(np.concatenate((header, payload), axis=-1)).reshape(rows, -1))


@pytest.mark.parametrize("unit", PRODUCT_UNITS)
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("k", [64, 96, 576, 1056])
def test_integer_sums_are_exact(unit: str, type_name: str, k: int) -> None:
    """Scales of 1 (and Q4_1's m = 2), x integers whose block absmax is 32767 (so x's d is 1 and its quants are x):
    every product, partial sum and scale is an integer below 2^24, so any exact integer arithmetic gives the int64
    reference's bits. The 32767 of each block meets a zero weight, which keeps the sums below 2^24."""
    rng = np.random.default_rng(k)
    n, num_rows, num_blocks = 19, 5, k // 32
    x = rng.integers(-100, 101, size=(num_rows, num_blocks, 32))
    peaks = rng.integers(0, 32, size=(num_rows, num_blocks))
    np.put_along_axis(x, peaks[..., None], rng.choice([-32767, 32767], size=(num_rows, num_blocks, 1)), axis=-1)
    if type_name == "Q8_0":
        quants, zero, offset = rng.integers(-128, 128, size=(n, num_blocks, 32)), 0, 0
    else:
        quants = rng.integers(0, 16, size=(n, num_blocks, 32))
        zero, offset = (8, -8) if type_name == "Q4_0" else (0, 2)
    for row in range(num_rows):  # the peak's weight is zero in every weight row (Q4_1: its m, 2, remains)
        quants[:, np.arange(num_blocks), peaks[row]] = zero
    blocks = integer_blocks(type_name, quants.reshape(n, k), 1.0, 2.0)
    weight = torch.from_numpy(quants.reshape(n, k) + offset)
    expected = torch.from_numpy(x.reshape(num_rows, k)) @ weight.T  # int64
    assert int(expected.abs().max()) < 2 ** 24
    x_float = torch.from_numpy(x.reshape(num_rows, k)).float()
    assert torch.equal(reference_values(blocks, GGMLQuantizationType[type_name].value, k), weight.float())
    output = torch.ops.pagedserve.gguf_linear(x_float, blocks, GGMLQuantizationType[type_name].value, None,
                                              product_unit(unit))
    assert torch.equal(output, expected.float())


@pytest.mark.parametrize("type_name, products", [("Q5_1", None), ("Q4_1", ("vector",))])
def test_large_batches_dequantize_tiles_for_a_gemm(monkeypatch, type_name: str, products: tuple | None) -> None:
    """Q5_1 (no amx unit for it) wherever the kernels run; Q4_1 in a build or process without the amx unit."""
    if products is not None:
        monkeypatch.setitem(gguf_linear._ops, "products", products)
    ggml_type, k, n = GGMLQuantizationType[type_name].value, 256, 50
    blocks = blocks_of(type_name, n, k)
    x = torch.randn(KERNEL_MAX_ROWS + 3, k)
    assert not runs_on_kernel(x.shape[0], ggml_type)
    weight = reference_values(blocks, ggml_type, k)
    whole = quantized_linear(x, blocks, ggml_type, k, None)
    torch.testing.assert_close(whole, F.linear(x, weight), rtol=0, atol=0)
    monkeypatch.setattr(gguf_linear, "DEQUANTIZE_TILE_VALUES", 16 * k)  # 16-row tiles: 4 of them, the last short
    # Another GEMM shape: the same values up to the GEMM's blocking.
    torch.testing.assert_close(quantized_linear(x, blocks, ggml_type, k, None), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K"])
def test_large_batches_of_integer_types_take_the_amx_unit_where_it_runs(type_name: str) -> None:
    product_unit("amx")
    ggml_type, k, n = GGMLQuantizationType[type_name].value, 256, 50
    blocks = blocks_of(type_name, n, k)
    x = torch.randn(100, k)  # past the vector products' 64 rows
    assert runs_on_kernel(x.shape[0], ggml_type)
    output = quantized_linear(x, blocks, ggml_type, k, None)
    assert torch.equal(output, torch.ops.pagedserve.gguf_linear(x, blocks, ggml_type, None, "amx"))
    assert_close_to_float64(output, x, reference_values(blocks, ggml_type, k), ggml_type=ggml_type)


@pytest.mark.parametrize("type_name, unit", [("Q8_0", "vector"), ("Q4_0", "vector"), ("Q4_1", "vector"),
                                             ("Q5_1", "vector"), ("Q6_K", "vector"), ("Q8_0", "amx"),
                                             ("Q4_0", "amx"), ("Q4_1", "amx"), ("Q4_K", "amx")])
def test_a_row_is_bitwise_the_same_alone_in_a_batch_and_on_any_thread_count(type_name: str, unit: str) -> None:
    """Per unit: 'auto' picks the unit by batch size (the amx unit from a few rows), so a row's bits are those of its
    unit (batch_invariant=True dequantizes GGUF weights at load for that reason)."""
    ggml_type = GGMLQuantizationType[type_name].value
    k, n = (768 if BLOCK_FORMATS[ggml_type][0] == 256 else 576), 300  # 576: 18 blocks, a short last group of 4
    blocks = blocks_of(type_name, n, k)
    x = torch.randn(20 if unit == "amx" else KERNEL_MAX_ROWS, k)  # amx: a whole tile of 16 rows and a short one
    products = product_unit(unit)
    batch = torch.ops.pagedserve.gguf_linear(x, blocks, ggml_type, None, products)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for row in range(x.shape[0]):
            alone = torch.ops.pagedserve.gguf_linear(x[row:row + 1], blocks, ggml_type, None, products)
            assert torch.equal(alone, batch[row:row + 1])
    finally:
        torch.set_num_threads(threads)


def test_bfloat16_inputs_compute_in_float32() -> None:
    ggml_type, k, n = GGMLQuantizationType.Q8_0.value, 128, 16
    blocks = blocks_of("Q8_0", n, k)
    x = torch.randn(3, 2, k).bfloat16()
    output = quantized_linear(x, blocks, ggml_type, k, None)
    assert output.dtype == torch.bfloat16 and output.shape == (3, 2, n)
    expected = quantized_linear(x.float().reshape(6, k), blocks, ggml_type, k, None).reshape(3, 2, n).bfloat16()
    assert torch.equal(output, expected)


def test_errors_name_the_problem() -> None:
    blocks = blocks_of("Q4_1", 4, 64)
    op = torch.ops.pagedserve
    with pytest.raises(RuntimeError, match="K=96 is not a multiple"):
        op.gguf_linear(torch.randn(1, 96), blocks_of("Q4_K", 4, 256), 12, None)
    with pytest.raises(RuntimeError, match="weight rows hold 40 bytes, K=128 needs 80"):
        op.gguf_linear(torch.randn(1, 128), blocks, 3, None)
    with pytest.raises(RuntimeError, match="ggml type 1 has no kernel"):
        op.gguf_linear(torch.randn(1, 64), blocks, 1, None)
    with pytest.raises(RuntimeError, match="M=65 exceeds 64"):
        op.gguf_linear(torch.randn(65, 64), blocks, 3, None, "vector")
    with pytest.raises(RuntimeError, match="products must be 'auto', 'amx' or 'vector', got 'tiles'"):
        op.gguf_linear(torch.randn(1, 64), blocks, 3, None, "tiles")
    if "amx" in gguf_linear_products():
        with pytest.raises(RuntimeError, match="products='amx' takes Q8_0, Q4_0, Q4_1 or Q4_K blocks, got ggml type 7"):
            op.gguf_linear(torch.randn(1, 64), blocks_of("Q5_1", 4, 64), 7, None, "amx")
    else:
        with pytest.raises(RuntimeError, match="products='amx' is not available in this build or process"):
            op.gguf_linear(torch.randn(1, 64), blocks, 3, None, "amx")
    with pytest.raises(RuntimeError, match="a float32 bias of 4 values"):
        op.gguf_linear(torch.randn(1, 64), blocks, 3, torch.randn(5))
    with pytest.raises(IndexError, match="row id 4 is outside the table's 4 rows"):
        quantized_rows(blocks, 3, 64, torch.tensor([1, 4]), torch.float32)


def test_every_tensor_of_the_smollm2_file() -> None:
    try:
        path = resolve_model_path(None)
    except ValueError as error:
        pytest.skip(str(error))
    reader = GGUFReader(path)
    x_by_k: dict[int, torch.Tensor] = {}
    num_checked = 0
    for tensor in reader.tensors:
        ggml_type = int(tensor.tensor_type)
        if ggml_type not in KERNEL_TYPES:
            continue
        rows, k = (int(d) for d in reversed(tensor.shape.tolist()))
        blocks = torch.from_numpy(np.array(tensor.data).view(np.uint8).reshape(rows, -1))
        reference = torch.from_numpy(dequantize(tensor.data, ggml_type, (rows, k)))
        assert torch.equal(dequantize_weight(blocks, ggml_type, k).view(torch.int32), reference.view(torch.int32)), \
            tensor.name
        x = x_by_k.setdefault(k, torch.randn(2, k, generator=torch.Generator().manual_seed(k)))
        assert_close_to_float64(quantized_linear(x, blocks, ggml_type, k, None), x, reference, ggml_type=ggml_type)
        num_checked += 1
    assert num_checked == 211  # 30 layers x 7 Q4_1 matrices and the Q8_0 embedding
