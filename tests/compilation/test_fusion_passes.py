"""Fusion passes on traced graphs: each pattern found, replaced, counted, outputs equal; no pattern: no change."""
from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from pagedserve.compilation.add_rms_norm_fusion import AddRMSNormQuantFusionPass
from pagedserve.compilation.fused_operators import (add_rms_norm_reference, muls_add_reference,
                                                    qk_norm_rope_reference)
from pagedserve.compilation.muls_add_fusion import MulsAddFusionPass
from pagedserve.compilation.pass_manager import build_fusion_pass_manager
from pagedserve.compilation.qk_norm_rope_fusion import QKNormRopeFusionPass
from pagedserve.config.compilation import CompilationConfig
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import get_rope
from pagedserve.models.qwen3 import Qwen3Attention


def _random_weight(norm: RMSNorm, seed: int) -> RMSNorm:
    generator = torch.Generator().manual_seed(seed)
    norm.weight.data = torch.rand(norm.weight.shape, generator=generator).to(norm.weight.dtype) + 0.5
    return norm


class ResidualNorms(nn.Module):
    """Two decoder-style fused residual norms around a projection (the layers' real RMSNorm)."""

    def __init__(self, hidden_size: int = 32, eps: float = 1e-5, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.norm1 = _random_weight(RMSNorm(hidden_size, eps, params_dtype=dtype), 1)
        self.norm2 = _random_weight(RMSNorm(hidden_size, eps, params_dtype=dtype), 2)
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.norm1(x, residual)
        hidden, residual = self.norm2(self.proj(hidden), residual)
        return hidden, residual


class QKNormRope(nn.Module):
    """Qwen3's q/k norm (the real method) followed by RotaryEmbedding.forward_native's rotation."""

    def __init__(self, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16, eps: float = 1e-6) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.q_norm = _random_weight(RMSNorm(head_dim, eps), 3)
        self.k_norm = _random_weight(RMSNorm(head_dim, eps), 4)
        self.rotary_emb = get_rope(head_dim, 64, {"rope_type": "default", "rope_theta": 10000.0})

    def forward(self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        query, key = Qwen3Attention.normalize_query_key(self, query, key)  # type: ignore[arg-type]
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return self.rotary_emb._rotate(query, cos, sin), self.rotary_emb._rotate(key, cos, sin)


def _count_targets(graph_module: fx.GraphModule, op: object) -> int:
    return sum(1 for node in graph_module.graph.nodes if node.op == "call_function" and node.target is op)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_fused(dtype: torch.dtype) -> None:
    module = ResidualNorms(dtype=dtype)
    graph_module = fx.symbolic_trace(module)
    x, residual = torch.randn(5, 32, dtype=dtype), torch.randn(5, 32, dtype=dtype)
    expected = graph_module(x, residual)
    assert AddRMSNormQuantFusionPass()(graph_module) == 2
    assert _count_targets(graph_module, torch.ops.pagedserve.fused_add_rms_norm.default) == 2
    assert _count_targets(graph_module, torch.rsqrt) == 0
    actual = graph_module(x, residual)
    torch.testing.assert_close(actual[0], expected[0], rtol=0, atol=0 if dtype == torch.float32 else 1e-2)
    assert torch.equal(actual[1], expected[1])  # the residual stream is the plain sum


def test_add_rms_norm_in_a_dynamo_graph() -> None:
    # Dynamo specialises the cast-back dtype to a literal and lifts parameters to placeholders.
    captured: list[tuple[fx.GraphModule, list[torch.Tensor]]] = []

    def capture(graph_module: fx.GraphModule, example_inputs: list[torch.Tensor]):
        captured.append((graph_module, list(example_inputs)))
        return graph_module.forward

    module = ResidualNorms()
    x, residual = torch.randn(3, 32), torch.randn(3, 32)
    torch.compile(module, backend=capture, dynamic=False, fullgraph=True)(x, residual)
    graph_module, example_inputs = captured[0]
    expected = graph_module(*example_inputs)
    assert AddRMSNormQuantFusionPass()(graph_module) == 2
    actual = graph_module(*example_inputs)
    torch.testing.assert_close(actual[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(actual[0], module(x, residual)[0], rtol=0, atol=0)


def test_add_rms_norm_absent_leaves_graph_unchanged() -> None:
    class NormOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = RMSNorm(32, 1e-5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(x)  # no residual add: not the pattern

    graph_module = fx.symbolic_trace(NormOnly())
    code = graph_module.code
    assert AddRMSNormQuantFusionPass()(graph_module) == 0
    assert graph_module.code == code


def test_add_rms_norm_quant_hook_is_inert() -> None:
    graph_module = fx.symbolic_trace(ResidualNorms())
    assert all(AddRMSNormQuantFusionPass().quant_consumer(node) is None for node in graph_module.graph.nodes)


def test_qk_norm_rope_fused() -> None:
    module = QKNormRope()
    graph_module = fx.symbolic_trace(module)
    num_tokens = 6
    query, key = torch.randn(num_tokens, 64), torch.randn(num_tokens, 32)
    positions = torch.arange(num_tokens) * 3
    cos, sin = module.rotary_emb.cos_sin(positions, torch.float32)
    expected = graph_module(query, key, cos, sin)
    assert QKNormRopeFusionPass()(graph_module) == 1
    assert _count_targets(graph_module, torch.ops.pagedserve.qk_norm_rope.default) == 1
    assert _count_targets(graph_module, torch.rsqrt) == 0 and _count_targets(graph_module, torch.cat) == 0
    actual = graph_module(query, key, cos, sin)
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # The op's reference agrees with the unfused layers too.
    reference = qk_norm_rope_reference(query, key, module.q_norm.weight, module.k_norm.weight, cos, sin, 4, 2, 16, 1e-6)
    torch.testing.assert_close(reference[0], expected[0], rtol=1e-6, atol=1e-6)


def test_qk_norm_rope_absent_leaves_graph_unchanged() -> None:
    class RopeWithoutNorm(QKNormRope):  # Llama: RoPE on un-normalised q/k
        def forward(self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
            return self.rotary_emb._rotate(query, cos, sin), self.rotary_emb._rotate(key, cos, sin)

    graph_module = fx.symbolic_trace(RopeWithoutNorm())
    code = graph_module.code
    assert QKNormRopeFusionPass()(graph_module) == 0
    assert graph_module.code == code


def test_muls_add_fused_and_absent() -> None:
    def scaled_sums(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        first = x * 2.5 + y
        return first * 0.125 + z

    graph_module = fx.symbolic_trace(scaled_sums)
    x, y, z = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    expected = scaled_sums(x, y, z)
    assert MulsAddFusionPass()(graph_module) == 2
    assert _count_targets(graph_module, torch.ops.pagedserve.muls_add.default) == 2
    torch.testing.assert_close(graph_module(x, y, z), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(muls_add_reference(x, y, 2.5), torch.ops.pagedserve.muls_add(x, y, 2.5))

    def not_the_pattern(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (x * y + z) + (x * 0.5 - y)  # tensor scale; subtraction

    other = fx.symbolic_trace(not_the_pattern)
    code = other.code
    assert MulsAddFusionPass()(other) == 0
    assert other.code == code


def test_pass_manager_applies_enabled_passes() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norms = ResidualNorms()
            self.qk = QKNormRope()

        def forward(self, x, residual, query, key, cos, sin):
            hidden, residual = self.norms(x, residual)
            query, key = self.qk(query, key, cos, sin)
            return hidden * 0.5 + residual, query, key

    module = Block()
    inputs = (torch.randn(6, 32), torch.randn(6, 32), torch.randn(6, 64), torch.randn(6, 32),
              *module.qk.rotary_emb.cos_sin(torch.arange(6), torch.float32))
    expected = module(*inputs)

    unchanged = fx.symbolic_trace(module)
    code = unchanged.code
    manager = build_fusion_pass_manager(CompilationConfig(fuse_norm_quant=False, fuse_qknorm_rope=False,
                                                         fuse_muls_add=False))
    assert manager(unchanged).code == code and manager.passes == []

    graph_module = fx.symbolic_trace(module)
    manager = build_fusion_pass_manager(CompilationConfig())
    assert manager(graph_module) is graph_module
    assert manager.num_replacements == {"fuse_norm_quant": 2, "fuse_qknorm_rope": 1, "fuse_muls_add": 1}
    for got, want in zip(graph_module(*inputs), expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

    only_muls = build_fusion_pass_manager(CompilationConfig(fuse_norm_quant=False, fuse_qknorm_rope=False))
    only_muls(fx.symbolic_trace(module))
    assert only_muls.num_replacements == {"fuse_muls_add": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("native", [True, False], ids=["native", "aten"])
def test_fused_add_rms_norm_matches_reference(monkeypatch, dtype: torch.dtype, native: bool) -> None:
    """Bitwise the unfused reference, through the native CPU kernel when it is built (counted) and through the
    ATen body when it is not."""
    from pagedserve.kernels import elementwise as native_elementwise

    if native and not native_elementwise.native_elementwise_available():
        pytest.skip("the native CPU kernels are not built here")
    calls = []
    real = native_elementwise.add_rms_norm
    monkeypatch.setattr(native_elementwise, "add_rms_norm", lambda *args: calls.append(1) or real(*args))
    if not native:
        monkeypatch.setattr(native_elementwise, "qualifies", lambda x: False)
    x, residual = torch.randn(3, 5, 576).to(dtype), torch.randn(3, 5, 576).to(dtype)
    weight = torch.rand(576).to(dtype)
    fused = torch.ops.pagedserve.fused_add_rms_norm(x, residual, weight, 1e-6)
    reference = add_rms_norm_reference(x, residual, weight, 1e-6)
    assert len(calls) == int(native)
    assert torch.equal(fused[0], reference[0]) and torch.equal(fused[1], reference[1])


def test_compilation_config_validates() -> None:
    with pytest.raises(ValueError, match="fuse_muls_add='yes'"):
        CompilationConfig(fuse_muls_add="yes")  # type: ignore[arg-type]
