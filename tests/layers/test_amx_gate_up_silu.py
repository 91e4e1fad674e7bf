"""layers/amx_gate_up_silu.py: gate_up projection and SiLU-and-mul in one native pass, bitwise the unfused pair."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.layers import amx_gate_up_silu
from pagedserve.kernels import elementwise as native_elementwise
from pagedserve.layers.amx_gate_up_silu import MIN_FUSED_ROWS, amx_linear_silu_and_mul, fused_op_available
from pagedserve.layers.amx_linear import amx_linear, amx_linear_available, amx_pack
from pagedserve.layers.weight_layout import apply_weight_layout
from pagedserve.models import llama
from pagedserve.models.llama import LlamaMLP

pytestmark = pytest.mark.skipif(
    not (amx_linear_available() and fused_op_available() and native_elementwise.native_elementwise_available()),
    reason="no product unit of the tile-packed kernel here (CPU without AVX2), or the native kernels are not built")

BF16 = torch.bfloat16


def _random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16)


@pytest.mark.parametrize("m", [1, 17, 257, 300, 600])
@pytest.mark.parametrize("n, k, has_bias", [(3072, 576, False), (256, 64, True), (384, 1536, True)])
def test_fused_op_is_bitwise_the_projection_then_silu_and_mul(linear_products: str, m: int, n: int, k: int,
                                                             has_bias: bool) -> None:
    """Panels of group pairs (3072 x 576: 24 pairs, six panels of 4; 384 x 1536: 3 panels of one pair; 256 x 64:
    one panel of 2), chunks of 32 rows (AMX, AVX-512 FMA), 35 (AVX2) or 36 (dot products) with shorter tails,
    biases, one and all threads, on each product unit."""
    weight, x = _random(n, k, seed=n + k) / k ** 0.5, _random(m, k, seed=m)
    bias = _random(n, seed=3) if has_bias else None
    packed = amx_pack(weight)
    unfused = native_elementwise.silu_and_mul(amx_linear(x, packed, bias, n, linear_products))
    threads = torch.get_num_threads()
    try:
        for num_threads in {1, threads}:
            torch.set_num_threads(num_threads)
            fused = amx_linear_silu_and_mul(x, packed, bias, n, linear_products)
            assert fused.shape == (m, n // 2) and fused.dtype == BF16
            assert torch.equal(_bits(fused), _bits(unfused))
    finally:
        torch.set_num_threads(threads)


def test_shapes_the_kernel_does_not_take_raise_clear_errors() -> None:
    x = _random(4, 64, seed=1)
    with pytest.raises(RuntimeError, match=r"n=192 \(2 x d, d a multiple of 64\)"):
        amx_linear_silu_and_mul(x, amx_pack(_random(192, 64, seed=2)), None, 192)
    with pytest.raises(RuntimeError, match=r"K=48 \(a multiple of 32\)"):
        amx_linear_silu_and_mul(_random(4, 48, seed=3), amx_pack(_random(128, 48, seed=4)), None, 128)
    with pytest.raises(RuntimeError, match="a bias of 128 values expected"):
        amx_linear_silu_and_mul(x, amx_pack(_random(128, 64, seed=5)), _random(64, seed=6), 128)


def _mlp(layout: str) -> LlamaMLP:
    mlp = LlamaMLP(64, 128, bias=False, params_dtype=BF16, prefix="mlp")
    with torch.no_grad():
        for seed, parameter in enumerate(mlp.parameters()):
            parameter.copy_(_random(*parameter.shape, seed=10 + seed) / 8)
    apply_weight_layout(mlp, layout)
    return mlp


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    assert fused_op_available()
    calls: list[int] = []
    real = amx_gate_up_silu._op
    monkeypatch.setattr(amx_gate_up_silu, "_op", lambda *args: calls.append(1) or real(*args))
    return calls


@torch.inference_mode()
def test_mlp_takes_the_fused_pass_only_where_it_pays_and_is_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    mlp = _mlp("amx_packed")
    calls = _counting(monkeypatch)

    def unfused(x: torch.Tensor) -> torch.Tensor:
        return mlp.down_proj(mlp.act_fn(mlp.gate_up_proj(x)))

    prefill = _random(300, 64, seed=20)
    assert torch.equal(_bits(mlp(prefill)), _bits(unfused(prefill))) and calls == [1]
    # Decode-sized batches keep the two kernels.
    decode = _random(MIN_FUSED_ROWS - 1, 64, seed=21)
    assert torch.equal(_bits(mlp(decode)), _bits(unfused(decode))) and calls == [1]
    # A hook on either module must fire: the modules run.
    seen: list[int] = []
    handle = mlp.act_fn.register_forward_hook(lambda module, inputs, output: seen.append(1))
    try:
        assert torch.equal(_bits(mlp(prefill)), _bits(unfused(prefill)))
    finally:
        handle.remove()
    assert calls == [1] and seen == [1, 1]
    # The plain layout has no packed weight to fuse over.
    plain = _mlp("plain")
    assert torch.equal(_bits(plain(prefill)), _bits(plain.down_proj(plain.act_fn(plain.gate_up_proj(prefill)))))
    assert calls == [1]


def test_engine_tokens_and_logprobs_are_the_same_with_and_without_fusion(tiny_model_dir, monkeypatch) -> None:
    """On/off equivalence: prompts past MIN_FUSED_ROWS tokens prefill through the fused pass; greedy tokens and
    top-5 logprobs over 24 steps are identical with it turned off."""
    folder = tiny_model_dir("llama", dtype=BF16)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 8 for i in range(280 + 40 * j)]} for j in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)

    def run() -> list:
        llm = LLM(folder, dtype="bfloat16", max_model_len=512, num_kv_blocks=128, weight_layout="amx_packed")
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                for o in outputs]

    calls = _counting(monkeypatch)
    fused = run()
    assert calls, "the prefill did not take the fused pass"
    monkeypatch.setattr(llama, "fused_gate_up_silu_and_mul", lambda *args: None)
    assert run() == fused
