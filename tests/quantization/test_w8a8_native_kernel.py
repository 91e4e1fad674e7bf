"""The native W8A8 linear (kernels/cpu/int8_linear.cpp) against the plain-PyTorch forms of int8_matmul.py: the
quantization, the exact int32 products and the float32 epilogue, bitwise, for every shape class the kernel's tiles
and tails take, both activation schemes, float32 and bfloat16, already quantized input, any thread count, and every
product unit this build and process runs (int16, avx512_vnni, amx: `products=`), each against the reference."""
from __future__ import annotations

import pytest
import torch

from pagedserve.layers.quantization.int8_matmul import (int8_matmul_exact, native_w8a8_linear, quantize_per_tensor,
                                                         quantize_per_token)

pytestmark = pytest.mark.skipif(
    native_w8a8_linear() is None,
    reason="no native CPU kernel build here (PAGEDSERVE_CPU_ISA=none, or a CPU without one): W8A8 layers run the "
           "PyTorch forms that tests/quantization/test_w8a8_linear.py covers")

# (M, N, K): decode rows, every tile remainder (M mod 4, N mod the tile's columns), K with and without a 16-value
# and a 64-value tail; for the AMX tiles (K a multiple of 64): one and two 16-row blocks with partial ones (M 16, 17,
# 33, 64), and N with 32-column pairs, a lone 16-column block and fewer than 16 left (130, 40, 53).
SHAPES = [(1, 64, 96), (1, 37, 30), (2, 9, 45), (3, 100, 33), (4, 8, 16), (5, 576, 576), (16, 48, 64),
          (17, 130, 192), (33, 53, 128), (64, 40, 1536), (6, 70, 200)]
PRODUCTS = tuple(torch.ops.pagedserve.w8a8_linear_products()) if native_w8a8_linear() is not None else ()


def _units_for(shape: tuple[int, int, int]) -> list[str]:
    """Every unit that runs here and takes this shape ('amx' needs K a multiple of 64), and 'auto'."""
    return ["auto", *(unit for unit in PRODUCTS if unit != "amx" or shape[2] % 64 == 0)]


def _reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               input_scale: torch.Tensor | None) -> torch.Tensor:
    if input_scale is None:
        x_q, x_scale = quantize_per_token(x)
    else:
        x_q, x_scale = quantize_per_tensor(x, input_scale), input_scale
    output = int8_matmul_exact(x_q, weight).float() * x_scale * weight_scale.reshape(1, -1)
    if bias is not None:
        output = output + bias
    return output.to(x.dtype)


def _inputs(shape: tuple[int, int, int], dtype: torch.dtype, seed: int):
    num_rows, output_size, input_size = shape
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(num_rows, input_size, generator=generator) * 3).to(dtype)
    if num_rows > 1:
        x[1] = 0  # an all-zero row: scale 0, quants 0
    weight = torch.randint(-128, 128, (output_size, input_size), dtype=torch.int8, generator=generator)
    weight_scale = torch.rand(output_size, 1, generator=generator) * 0.01 + 1e-4
    bias = torch.randn(output_size, generator=generator).to(dtype)
    return x, weight, weight_scale, bias


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_kernel_equals_pytorch_forms_bitwise(shape: tuple[int, int, int], dtype: torch.dtype, static: bool) -> None:
    x, weight, weight_scale, bias = _inputs(shape, dtype, seed=sum(shape))
    # A static scale small enough that some values clamp at -128 and 127.
    input_scale = torch.tensor([0.03]) if static else None
    kernel = native_w8a8_linear()
    x_q, x_scale = (quantize_per_tensor(x, input_scale), input_scale) if static else quantize_per_token(x)
    for products in _units_for(shape):
        for with_bias in (bias, None):
            output = kernel(x, weight, weight_scale, input_scale, with_bias, None, products)
            assert output.dtype == dtype and output.shape == (shape[0], shape[1])
            assert torch.equal(output, _reference(x, weight, weight_scale, with_bias, input_scale)), products
        # The already quantized form (the norm+quant fusion's): int8 x with its scales.
        output = kernel(x_q, weight, weight_scale, x_scale, bias, dtype, products)
        assert torch.equal(output, _reference(x, weight, weight_scale, bias, input_scale)), products


def test_units_match_the_isa_level() -> None:
    """The build of each level has its units: VNNI from avx512_bf16 (which compiles AVX512-VNNI), AMX at amx."""
    from pagedserve.kernels import cpu_isa

    level = cpu_isa.selected_level()
    assert "int16" in PRODUCTS
    has_vnni = cpu_isa.LEVELS.index(level) >= cpu_isa.LEVELS.index("avx512_bf16")
    assert ("avx512_vnni" in PRODUCTS) == has_vnni
    if level != "amx":
        assert "amx" not in PRODUCTS
    with pytest.raises(RuntimeError, match="products must be"):
        native_w8a8_linear()(torch.zeros(1, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8), None, None,
                             None, "vnni")
    if "amx" in PRODUCTS:
        with pytest.raises(RuntimeError, match="K a multiple of 64, got K=96"):
            native_w8a8_linear()(torch.zeros(16, 96), torch.zeros(8, 96, dtype=torch.int8), torch.ones(8), None, None,
                                 None, "amx")


@pytest.mark.parametrize("input_size", [4099, 4096])
def test_extreme_products_are_exact(input_size: int) -> None:
    # Every product at its largest magnitude, -128 x -128, over a long K: the int32 sum must not saturate anywhere
    # (VPDPBUSD's biased sums, 128 more per weight value, pass 2^31 here and must wrap back exactly).
    num_rows, output_size = 17, 35
    x_q = torch.full((num_rows, input_size), -128, dtype=torch.int8)
    weight = torch.full((output_size, input_size), -128, dtype=torch.int8)
    mixed = torch.randint(-128, 128, (num_rows, input_size), dtype=torch.int8,
                          generator=torch.Generator().manual_seed(3))
    for products in _units_for((num_rows, output_size, input_size)):
        output = native_w8a8_linear()(x_q, weight, torch.ones(output_size), torch.ones(1), None, torch.float32,
                                      products)
        assert torch.equal(output, torch.full((num_rows, output_size), float(128 * 128 * input_size))), products
        output = native_w8a8_linear()(mixed, weight, torch.ones(output_size), torch.ones(1), None, torch.float32,
                                      products)
        assert torch.equal(output, int8_matmul_exact(mixed, weight).float()), products


@pytest.mark.parametrize("num_rows", [9, 40])
def test_result_does_not_depend_on_threads_or_batch(num_rows: int) -> None:
    # 40 rows: 'auto' takes the AMX tiles where they run, and each single row the VNNI or int16 unit.
    x, weight, weight_scale, bias = _inputs((num_rows, 200, 576), torch.float32, seed=4)
    kernel = native_w8a8_linear()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernel(x, weight, weight_scale, None, bias)
    finally:
        torch.set_num_threads(threads)
    together = kernel(x, weight, weight_scale, None, bias)
    assert torch.equal(alone, together)
    for row in (0, 4, num_rows - 1):
        assert torch.equal(kernel(x[row:row + 1], weight, weight_scale, None, bias), together[row:row + 1])


def test_bad_arguments_name_the_problem() -> None:
    kernel = native_w8a8_linear()
    weight = torch.zeros(8, 16, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="K=15"):
        kernel(torch.zeros(2, 15), weight, torch.ones(8), None, None)
    with pytest.raises(RuntimeError, match="weight_scale holds 7 values"):
        kernel(torch.zeros(2, 16), weight, torch.ones(7), None, None)
    with pytest.raises(RuntimeError, match="int8 weight"):
        kernel(torch.zeros(2, 16), weight.float(), torch.ones(8), None, None)
    with pytest.raises(RuntimeError, match="needs its scales"):
        kernel(torch.zeros(2, 16, dtype=torch.int8), weight, torch.ones(8), None, None, torch.float32)


def test_layer_takes_the_kernel_and_equals_its_pytorch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from test_w8a8_linear import _layer, _quantized

    from pagedserve.layers.linear import ColumnParallelLinear
    from pagedserve.layers.quantization import w8a8_int8

    layer = _layer(ColumnParallelLinear, 96, 40, bias=True, prefix="model.layers.0.mlp.up_proj")
    weight, weight_scale = _quantized(40, 96, seed=5)
    layer.weight.weight_loader(layer.weight, weight)
    layer.weight_scale.weight_loader(layer.weight_scale, weight_scale)
    layer.bias.weight_loader(layer.bias, torch.randn(40))
    layer.linear_method.process_weights_after_loading(layer)
    x = torch.randn(3, 7, 96, generator=torch.Generator().manual_seed(6))
    calls = []
    kernel = native_w8a8_linear()
    monkeypatch.setattr(w8a8_int8, "native_w8a8_linear", lambda: lambda *args: calls.append(1) or kernel(*args))
    with_kernel = layer(x)
    assert calls, "the layer did not take the native kernel"
    monkeypatch.setattr(w8a8_int8, "native_w8a8_linear", lambda: None)
    assert torch.equal(with_kernel, layer(x))
