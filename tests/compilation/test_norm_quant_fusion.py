"""Norm + quant fusion (issue #30 part 3): a fused residual RMSNorm whose output feeds a W8A8 dynamic linear
produces the int8 activation and its scale in one op; the graph's outputs are bitwise those of the unfused graph;
a static W8A8 consumer, or a norm output with another user, is left unfused."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import fx, nn

from pagedserve.compilation.add_rms_norm_fusion import AddRMSNormQuantFusionPass
from pagedserve.compilation.fused_operators import add_rms_norm_quant_reference, fused_add_rms_norm_quant
from pagedserve.layers.linear import ColumnParallelLinear
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.quantization.compressed_tensors_config import CompressedTensorsConfig
from pagedserve.layers.quantization.quantization_context import building_with_quantization

sys.path.insert(0, str(Path(__file__).parents[1] / "quantization"))
from w8a8_configs import w8a8_config  # noqa: E402

HIDDEN = 32


def _w8a8_linear(name: str, seed: int, static: bool) -> ColumnParallelLinear:
    with building_with_quantization(CompressedTensorsConfig.from_dict(w8a8_config(static=static))):
        layer = ColumnParallelLinear(HIDDEN, HIDDEN, bias=False, params_dtype=torch.float32, tp_rank=0, tp_size=1,
                                     prefix=f"model.layers.0.mlp.{name}")
    generator = torch.Generator().manual_seed(seed)
    layer.weight.weight_loader(layer.weight, torch.randint(-128, 128, (HIDDEN, HIDDEN), dtype=torch.int8,
                                                           generator=generator))
    layer.weight_scale.weight_loader(layer.weight_scale, torch.rand(HIDDEN, 1, generator=generator) * 0.01)
    if static:
        layer.input_scale.weight_loader(layer.input_scale, torch.tensor([0.03]))
    layer.linear_method.process_weights_after_loading(layer)
    return layer


class NormsIntoW8A8(nn.Module):
    def __init__(self, static: bool = False, norm_output_also_returned: bool = False) -> None:
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(HIDDEN, 1e-6), RMSNorm(HIDDEN, 1e-6)
        for index, norm in enumerate((self.norm1, self.norm2)):
            norm.weight.data = torch.rand(HIDDEN, generator=torch.Generator().manual_seed(index)) + 0.5
        self.proj1, self.proj2 = _w8a8_linear("up_proj", 1, static), _w8a8_linear("down_proj", 2, static)
        self.norm_output_also_returned = norm_output_also_returned

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden, residual = self.norm1(x, residual)
        normed = hidden
        hidden, residual = self.norm2(self.proj1(hidden), residual)
        outputs = (self.proj2(hidden), residual)
        return outputs + (normed,) if self.norm_output_also_returned else outputs


def _dynamo_graph(module: nn.Module, *inputs: torch.Tensor) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    captured: list[tuple[fx.GraphModule, list[torch.Tensor]]] = []

    def capture(graph_module: fx.GraphModule, example_inputs: list[torch.Tensor]):
        captured.append((graph_module, list(example_inputs)))
        return graph_module.forward

    module(*inputs)  # eager first: the native-kernel probe runs outside the trace (as in the engine)
    torch._dynamo.reset()
    torch.compile(module, backend=capture, dynamic=False, fullgraph=True)(*inputs)
    return captured[0]


def _count(graph_module: fx.GraphModule, op: object) -> int:
    return sum(1 for node in graph_module.graph.nodes if node.op == "call_function" and node.target is op)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return torch.randn(5, HIDDEN, generator=generator), torch.randn(5, HIDDEN, generator=generator)


def test_norm_quant_fused_on_equals_off() -> None:
    module = NormsIntoW8A8()
    graph_module, example_inputs = _dynamo_graph(module, *_inputs())
    assert _count(graph_module, torch.ops.pagedserve.quantize_per_token_int8.default) == 2
    unfused = graph_module(*example_inputs)
    fusion = AddRMSNormQuantFusionPass()
    assert fusion(graph_module) == 4  # two norms, then both norm + quant pairs
    assert fusion.num_norm_quant_fused == 2
    assert _count(graph_module, torch.ops.pagedserve.fused_add_rms_norm_quant.default) == 2
    assert _count(graph_module, torch.ops.pagedserve.quantize_per_token_int8.default) == 0
    assert _count(graph_module, torch.ops.pagedserve.fused_add_rms_norm.default) == 0
    fused = graph_module(*example_inputs)
    for actual, expected in zip(fused, unfused):
        assert torch.equal(actual, expected)
    for actual, expected in zip(fused, module(*_inputs())):  # and the eager modules
        assert torch.equal(actual, expected)


def test_static_consumer_or_shared_norm_output_stays_unfused() -> None:
    for module in (NormsIntoW8A8(static=True), NormsIntoW8A8(norm_output_also_returned=True)):
        graph_module, example_inputs = _dynamo_graph(module, *_inputs())
        expected = graph_module(*example_inputs)
        fusion = AddRMSNormQuantFusionPass()
        fusion(graph_module)
        num_unfused_quants = 0 if module.proj1.linear_method.is_static_input else 1
        assert fusion.num_norm_quant_fused == (0 if num_unfused_quants == 0 else 1)  # norm2 -> proj2 still fuses
        assert _count(graph_module, torch.ops.pagedserve.quantize_per_token_int8.default) == num_unfused_quants
        for actual, reference in zip(graph_module(*example_inputs), expected):
            assert torch.equal(actual, reference)


def test_fused_op_matches_reference() -> None:
    x, residual = _inputs()
    weight = torch.rand(HIDDEN) + 0.5
    for actual, expected in zip(fused_add_rms_norm_quant(x, residual, weight, 1e-6),
                                add_rms_norm_quant_reference(x, residual, weight, 1e-6)):
        assert torch.equal(actual, expected)
