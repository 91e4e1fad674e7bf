"""W8A8 int8 linear layers: the int8 GEMM against an integer reference, the method against the float32
dequantize-then-F.linear reference, and the weight loaders' TP sharding of int8 weights and their scales."""
from __future__ import annotations

import pytest
import torch

from pagedserve.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                      RowParallelLinear)
from pagedserve.layers.quantization.compressed_tensors_config import CompressedTensorsConfig
from pagedserve.layers.quantization.int8_matmul import int8_matmul_exact, quantize_per_token
from pagedserve.layers.quantization.quantization_context import building_with_quantization
from pagedserve.layers.quantization.w8a8_int8 import W8A8Int8LinearMethod, w8a8_reference_linear
from w8a8_configs import w8a8_config


def _int8(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=generator)


@pytest.mark.parametrize("shape", [(1, 64, 96), (3, 100, 33), (17, 576, 192), (64, 1536, 40)])
def test_int8_gemm_accumulators_equal_integer_reference(shape: tuple[int, int, int]) -> None:
    num_rows, input_size, output_size = shape
    generator = torch.Generator().manual_seed(sum(shape))
    x_q, weight = _int8(num_rows, input_size, generator=generator), _int8(output_size, input_size, generator=generator)
    accumulators = int8_matmul_exact(x_q, weight)
    assert accumulators.dtype == torch.int32
    reference = (x_q.to(torch.int64) @ weight.to(torch.int64).t()).to(torch.int32)
    assert torch.equal(accumulators, reference)
    # Extremes: every product at its largest magnitude.
    full = torch.full((num_rows, input_size), -128, dtype=torch.int8)
    assert torch.equal(int8_matmul_exact(full, torch.full_like(weight, -128)),
                       torch.full((num_rows, output_size), 128 * 128 * input_size, dtype=torch.int32))


def test_per_token_quantization() -> None:
    x = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.5, -0.01]])
    x_q, scale = quantize_per_token(x)
    assert torch.equal(scale.squeeze(1), torch.tensor([1.0, 0.0, 3.0]) / 127)
    assert torch.equal(x_q[0], torch.tensor([64, -127, 32], dtype=torch.int8))  # 63.5 rounds half to even
    assert torch.equal(x_q[1], torch.zeros(3, dtype=torch.int8))
    assert x_q[2].tolist() == [127, 64, 0]


def _layer(layer_class: type, *args, static: bool = False, tp_rank: int = 0, tp_size: int = 1, prefix: str,
           dtype: torch.dtype = torch.float32, **kwargs):
    config = CompressedTensorsConfig.from_dict(w8a8_config(static=static))
    with building_with_quantization(config):
        return layer_class(*args, params_dtype=dtype, tp_rank=tp_rank, tp_size=tp_size, prefix=prefix, **kwargs)


def _quantized(output_size: int, input_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (_int8(output_size, input_size, generator=generator),
            torch.rand(output_size, 1, generator=generator) * 0.01 + 1e-3)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_matches_dequantize_reference(static: bool, dtype: torch.dtype) -> None:
    layer = _layer(ColumnParallelLinear, 64, 48, bias=True, static=static, prefix="model.layers.0.mlp.up_proj",
                   dtype=dtype)
    assert isinstance(layer.linear_method, W8A8Int8LinearMethod) and layer.weight.dtype == torch.int8
    weight, weight_scale = _quantized(48, 64, seed=1)
    bias = torch.randn(48).to(dtype)
    layer.weight.weight_loader(layer.weight, weight)
    layer.weight_scale.weight_loader(layer.weight_scale, weight_scale)
    layer.bias.weight_loader(layer.bias, bias)
    input_scale = torch.tensor([0.02])
    if static:
        layer.input_scale.weight_loader(layer.input_scale, input_scale)
    layer.linear_method.process_weights_after_loading(layer)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    output = layer(x)
    assert output.shape == (2, 5, 48) and output.dtype == dtype
    reference = w8a8_reference_linear(x, weight, weight_scale, bias, input_scale if static else None)
    # float32: int32 accumulators scaled once vs a float32 dot product of dequantized values (rounding only).
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(output.float(), reference, atol=tolerance, rtol=tolerance)


def test_float_weight_for_a_quantized_layer_is_refused() -> None:
    layer = _layer(ColumnParallelLinear, 64, 48, bias=False, prefix="model.layers.0.mlp.up_proj")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight: .*float32.*int8"):
        layer.weight.weight_loader(layer.weight, torch.randn(48, 64))


def test_wrong_scale_shape_names_tensor_and_field() -> None:
    layer = _layer(RowParallelLinear, 64, 48, bias=False, prefix="model.layers.0.mlp.down_proj")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight_scale: .*\(48,\).*\(48, 1\)"):
        layer.weight_scale.weight_loader(layer.weight_scale, torch.rand(48))
    static = _layer(RowParallelLinear, 64, 48, bias=False, static=True, prefix="model.layers.0.mlp.down_proj")
    with pytest.raises(ValueError, match=r"down_proj\.input_scale: .*\(2,\)"):
        static.input_scale.weight_loader(static.input_scale, torch.rand(2))


def _full_output(layers: list, x: torch.Tensor, row_parallel: bool) -> torch.Tensor:
    if row_parallel:
        shard = x.shape[-1] // len(layers)
        return sum(layer(x[:, rank * shard:(rank + 1) * shard]) for rank, layer in enumerate(layers))
    return torch.cat([layer(x) for layer in layers], dim=-1)


def test_tensor_parallel_shards_weights_and_scales() -> None:
    """Two simulated ranks of each parallel kind hold the right rows (and scales) of the int8 checkpoint."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    # Column-parallel (gate/up merged): scales shard with the rows of each part.
    gate, gate_scale = _quantized(32, 64, seed=6)
    up, up_scale = _quantized(32, 64, seed=7)
    merged = [_layer(MergedColumnParallelLinear, 64, [32, 32], bias=False, tp_rank=rank, tp_size=2,
                     prefix="model.layers.0.mlp.gate_up_proj") for rank in range(2)]
    for layer in merged:
        for shard_id, (weight, scale) in enumerate(((gate, gate_scale), (up, up_scale))):
            layer.weight.weight_loader(layer.weight, weight, shard_id)
            layer.weight_scale.weight_loader(layer.weight_scale, scale, shard_id)
        layer.linear_method.process_weights_after_loading(layer)
    reference = w8a8_reference_linear(x, torch.cat([gate, up]), torch.cat([gate_scale, up_scale]), None)
    expected = torch.cat([reference[:, :16], reference[:, 32:48], reference[:, 16:32], reference[:, 48:]], dim=-1)
    torch.testing.assert_close(_full_output(merged, x, False), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(merged[1].weight_scale, torch.cat([gate_scale[16:], up_scale[16:]]))
    # QKV with 4 heads of 8 and 2 KV heads.
    qkv = [_layer(QKVParallelLinear, 64, 8, 4, 2, bias=False, tp_rank=rank, tp_size=2,
                  prefix="model.layers.0.self_attn.qkv_proj") for rank in range(2)]
    parts = {name: _quantized(rows, 64, seed=10 + index) for index, (name, rows) in enumerate((("q", 32), ("k", 16),
                                                                                               ("v", 16)))}
    for layer in qkv:
        for name, (weight, scale) in parts.items():
            layer.weight.weight_loader(layer.weight, weight, name)
            layer.weight_scale.weight_loader(layer.weight_scale, scale, name)
        layer.linear_method.process_weights_after_loading(layer)
    assert torch.equal(qkv[1].weight_scale, torch.cat([parts["q"][1][16:], parts["k"][1][8:], parts["v"][1][8:]]))
    # Row-parallel: the weight splits by input columns, the per-row scales stay whole.
    down, down_scale = _quantized(48, 64, seed=20)
    rows = [_layer(RowParallelLinear, 64, 48, bias=False, tp_rank=rank, tp_size=2,
                   prefix="model.layers.0.mlp.down_proj") for rank in range(2)]
    for layer in rows:
        layer.weight.weight_loader(layer.weight, down)
        layer.weight_scale.weight_loader(layer.weight_scale, down_scale)
        layer.linear_method.process_weights_after_loading(layer)
        assert torch.equal(layer.weight_scale, down_scale)
    # Each rank quantizes its own half of x per token (as vLLM's ranks do): compare per-shard references.
    expected = sum(w8a8_reference_linear(x[:, rank * 32:(rank + 1) * 32], down[:, rank * 32:(rank + 1) * 32],
                                         down_scale, None) for rank in range(2))
    torch.testing.assert_close(_full_output(rows, x, True), expected, atol=1e-5, rtol=1e-5)


def test_per_tensor_weight_scales_expand_to_rows() -> None:
    config = CompressedTensorsConfig.from_dict(w8a8_config(weight_strategy="tensor"))
    with building_with_quantization(config):
        layer = MergedColumnParallelLinear(64, [32, 32], bias=False, params_dtype=torch.float32, tp_rank=0,
                                           tp_size=1, prefix="model.layers.0.mlp.gate_up_proj")
    layer.weight_scale.weight_loader(layer.weight_scale, torch.tensor([0.5]), 0)
    layer.weight_scale.weight_loader(layer.weight_scale, torch.tensor(0.25), 1)
    assert torch.equal(layer.weight_scale.squeeze(1), torch.cat([torch.full((32,), 0.5), torch.full((32,), 0.25)]))


def test_static_input_scale_of_fused_parts_is_their_maximum() -> None:
    layer = _layer(QKVParallelLinear, 64, 8, 4, 2, bias=False, static=True, prefix="model.layers.0.self_attn.qkv_proj")
    for name, value in (("q", 0.1), ("k", 0.3), ("v", 0.2)):
        layer.input_scale.weight_loader(layer.input_scale, torch.tensor([value]), name)
    assert layer.input_scale.item() == pytest.approx(0.3)
