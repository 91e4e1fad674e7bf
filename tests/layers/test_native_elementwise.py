"""The native fused elementwise CPU kernels (kernels/cpu/elementwise.cpp) against forward_native.

The kernels reproduce forward_native's rounding points and ATen's summation order, so the comparisons are
bitwise (atol=0) for float32 and bfloat16; the one documented exception is SiLU on a row whose length is not a
multiple of ATen's vector (ATen's scalar tail), compared within one unit in the last place.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagedserve.kernels import cpu_library as cpu_native_extension
from pagedserve.kernels import elementwise as native_elementwise
from pagedserve.layers.activation import SiluAndMul
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import get_rope

DTYPES = [torch.float32, torch.bfloat16]
TOKEN_COUNTS = [1, 7, 64, 300]
NUM_HEADS, NUM_KV_HEADS = 9, 3


@pytest.fixture(autouse=True)
def native_kernels() -> None:
    # The kernels must build here: a silent fallback would make every comparison below compare
    # forward_native with itself.
    assert native_elementwise.native_elementwise_available()


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _norm(hidden: int, dtype: torch.dtype, eps: float = 1e-5) -> RMSNorm:
    norm = RMSNorm(hidden, eps, params_dtype=dtype)
    norm.weight.data = (torch.rand(hidden, generator=torch.Generator().manual_seed(hidden)) + 0.5).to(dtype)
    return norm


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Counts calls of the native op `name` (so a test can tell the kernel really ran)."""
    calls = [0]
    original = getattr(native_elementwise._Ops, name)

    def counted(*args: Any) -> Any:
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(native_elementwise._Ops, name, counted)
    return calls


def _qkv_views(num_tokens: int, head_dim: int, dtype: torch.dtype,
               seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query/key/value as the attention layer sees them: slices of one fused qkv output (row stride = width)."""
    q_size, kv_size = NUM_HEADS * head_dim, NUM_KV_HEADS * head_dim
    qkv = _random((num_tokens, q_size + 2 * kv_size), dtype, seed, scale=2.0)
    return qkv.split([q_size, kv_size, kv_size], dim=-1)


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("hidden", [576, 64, 100, 8, 4104])
def test_rms_norm_equals_forward_native(monkeypatch, dtype: torch.dtype, num_tokens: int, hidden: int) -> None:
    norm = _norm(hidden, dtype)
    x = _random((num_tokens, hidden), dtype, 1, scale=3.0)
    residual = _random((num_tokens, hidden), dtype, 2)
    x_before, residual_before = x.clone(), residual.clone()
    calls = _counting(monkeypatch, "rms_norm")
    fused_calls = _counting(monkeypatch, "add_rms_norm")
    torch.testing.assert_close(norm.forward_cpu(x), norm.forward_native(x), atol=0, rtol=0)
    output, new_residual = norm.forward_cpu(x, residual)
    expected_output, expected_residual = norm.forward_native(x, residual)
    torch.testing.assert_close(output, expected_output, atol=0, rtol=0)
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    assert calls[0] == 1 and fused_calls[0] == 1
    # The inputs are not written (callers such as Qwen3's q/k norm pass views they keep using).
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)
    assert output.is_contiguous() and output.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_on_a_strided_heads_view(monkeypatch, dtype: torch.dtype) -> None:
    """Qwen3's per-head q/k norm: [tokens, heads, head_dim] views of the qkv slices (non-contiguous rows)."""
    head_dim = 64
    query, key, _ = _qkv_views(13, head_dim, dtype, seed=3)
    norm = _norm(head_dim, dtype, eps=1e-6)
    calls = _counting(monkeypatch, "rms_norm")
    for tensor, heads in ((query, NUM_HEADS), (key, NUM_KV_HEADS)):
        view = tensor.reshape(13, heads, head_dim)
        assert not view.is_contiguous()
        torch.testing.assert_close(norm.forward_cpu(view), norm.forward_native(view), atol=0, rtol=0)
    # A 4-D input is flattened by the wrapper.
    x4 = _random((2, 3, 5, head_dim), dtype, 4)
    torch.testing.assert_close(norm.forward_cpu(x4), norm.forward_native(x4), atol=0, rtol=0)
    assert calls[0] == 3


def test_rms_norm_long_rows_use_the_summation_cascade() -> None:
    """Rows long enough for ATen's cascaded partial sums (>= 16 groups of 4 vectors) still match bitwise."""
    for hidden in (8192, 70000):
        norm = _norm(hidden, torch.float32)
        x = _random((2, hidden), torch.float32, hidden, scale=5.0)
        torch.testing.assert_close(norm.forward_cpu(x), norm.forward_native(x), atol=0, rtol=0)


# ---------------------------------------------------------------- rotary embedding

ROPE_PARAMETERS = {
    "default": {"rope_type": "default", "rope_theta": 100000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("rope_type", list(ROPE_PARAMETERS))
def test_rotary_equals_forward_native(monkeypatch, dtype: torch.dtype, num_tokens: int, rope_type: str) -> None:
    head_dim = 64
    rope = get_rope(head_dim, 512, ROPE_PARAMETERS[rope_type])
    if rope_type == "yarn":
        assert rope.attention_scaling != 1.0  # folded into the table: the kernel must read it from there
    query, key, _ = _qkv_views(num_tokens, head_dim, dtype, seed=num_tokens)
    # Positions up to the end of the table (dynamic's table extends past max_position_embeddings).
    positions = torch.randint(0, rope.max_positions, (num_tokens,), generator=torch.Generator().manual_seed(5))
    positions[0] = rope.max_positions - 1
    query_before, key_before = query.clone(), key.clone()
    calls = _counting(monkeypatch, "rotary_embedding")
    rotated = rope.forward_cpu(positions, query, key)
    expected = rope.forward_native(positions, query, key)
    assert calls[0] == 1
    torch.testing.assert_close(rotated[0], expected[0], atol=0, rtol=0)
    torch.testing.assert_close(rotated[1], expected[1], atol=0, rtol=0)
    assert torch.equal(query, query_before) and torch.equal(key, key_before)
    assert rotated[0].shape == query.shape and rotated[0].is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [128, 40, 6])
def test_rotary_other_head_sizes_and_layouts(dtype: torch.dtype, head_dim: int) -> None:
    """Head sizes whose half is not a multiple of the vector (tails), int32 positions, [tokens, heads, dim]."""
    rope = get_rope(head_dim, 256, ROPE_PARAMETERS["default"])
    query, key, _ = _qkv_views(7, head_dim, dtype, seed=head_dim)
    positions = torch.tensor([0, 1, 2, 100, 255, 31, 7], dtype=torch.int32)
    for q, k in ((query, key), (query.reshape(7, NUM_HEADS, head_dim), key.reshape(7, NUM_KV_HEADS, head_dim))):
        rotated, expected = rope.forward_cpu(positions, q, k), rope.forward_native(positions, q, k)
        torch.testing.assert_close(rotated[0], expected[0], atol=0, rtol=0)
        torch.testing.assert_close(rotated[1], expected[1], atol=0, rtol=0)


def test_rotary_rejects_positions_beyond_the_table() -> None:
    rope = get_rope(64, 16, ROPE_PARAMETERS["default"])
    query, key, _ = _qkv_views(2, 64, torch.float32, seed=0)
    with pytest.raises(ValueError, match="position 16 is beyond the rotary table"):
        rope.forward_cpu(torch.tensor([3, 16]), query, key)
    # The kernel checks each position itself too (memory safety when called directly).
    for position in (16, -1):
        with pytest.raises(RuntimeError, match="beyond the rotary table"):
            native_elementwise.rotary_embedding(torch.tensor([0, position]), query, key, rope.cos_sin_cache, 64)


def test_rotary_position_check_is_memoised_per_forward(monkeypatch) -> None:
    rope = get_rope(64, 32, ROPE_PARAMETERS["default"])
    query, key, _ = _qkv_views(3, 64, torch.float32, seed=0)
    positions = torch.tensor([0, 1, 2])
    checks = []
    original = rope.check_positions
    monkeypatch.setattr(rope, "check_positions", lambda p: (checks.append(p), original(p)))
    for _ in range(3):  # every layer passes the same positions tensor
        rope.forward_cpu(positions, query, key)
    assert len(checks) == 1
    rope.clear_memo()  # the model's next forward
    rope.forward_cpu(positions, query, key)
    assert len(checks) == 2


# ---------------------------------------------------------------- SiLU and mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("width", [1536, 64, 96])
def test_silu_and_mul_equals_forward_native(monkeypatch, dtype: torch.dtype, num_tokens: int, width: int) -> None:
    activation = SiluAndMul()
    x = _random((num_tokens, 2 * width), dtype, width, scale=4.0)
    calls = _counting(monkeypatch, "silu_and_mul")
    torch.testing.assert_close(activation.forward_cpu(x), activation.forward_native(x), atol=0, rtol=0)
    assert calls[0] == 1


@pytest.mark.parametrize("up_value", [1.5, -3.0, 2.0 ** -120])
def test_silu_and_mul_every_bfloat16_gate(up_value: float) -> None:
    """bfloat16 gates read the formula's result from a table of all 2^16 gate values: each of them (zeros,
    subnormals, infinities, NaNs) times an up value, against ATen's vector path bit for bit where ATen's result
    is a number (a NaN's sign and payload may differ: the kernel's rounding gives the canonical quiet NaN); the
    smallest up value makes most products subnormal."""
    gates = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = torch.cat([gates, torch.full_like(gates, up_value)]).view(1, -1)
    activation = SiluAndMul()
    native, reference = activation.forward_cpu(x), activation.forward_native(x)
    is_nan = reference.isnan()
    assert torch.equal(native.isnan(), is_nan)
    assert torch.equal(native[~is_nan].view(torch.int16), reference[~is_nan].view(torch.int16))
    # Tails of 1..15 gates (masked lanes) read the same entries.
    for width in (1, 15, 17):
        part = torch.cat([gates[1000:1000 + width], torch.full((width,), up_value).bfloat16()]).view(1, -1)
        assert torch.equal(activation.forward_cpu(part).view(torch.int16), native[:, 1000:1000 + width].view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_row_tails_and_shapes(dtype: torch.dtype) -> None:
    """A row length that is not a multiple of ATen's vector: ATen's scalar tail may differ in the last bit,
    the kernel keeps the vector formula (equal to forward_native's vector path: checked on whole vectors)."""
    activation = SiluAndMul()
    x = _random((5, 2 * 100), dtype, 9, scale=4.0)
    ulp = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -7
    torch.testing.assert_close(activation.forward_cpu(x), activation.forward_native(x), atol=1e-30, rtol=2 * ulp)
    x3 = _random((2, 3, 2 * 64), dtype, 10)
    out = activation.forward_cpu(x3)
    assert out.shape == (2, 3, 64)
    torch.testing.assert_close(out, activation.forward_native(x3), atol=0, rtol=0)
    # The elements on ATen's vector path agree bitwise.
    torch.testing.assert_close(activation.forward_cpu(x)[:, :96], activation.forward_native(x)[:, :96], atol=0,
                               rtol=0)


# ---------------------------------------------------------------- batch invariance


def _row_by_row_equals_batch(function: Callable[[torch.Tensor], torch.Tensor], batch: torch.Tensor) -> None:
    together = function(batch)
    for row in range(batch.shape[0]):
        assert torch.equal(function(batch[row:row + 1])[0], together[row]), f"row {row}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_token_is_computed_alone(dtype: torch.dtype) -> None:
    """A token's bits do not depend on the batch or the thread count (the reason the kernels stay on under
    batch_invariant=True)."""
    hidden, head_dim = 576, 64
    norm, activation = _norm(hidden, dtype), SiluAndMul()
    rope = get_rope(head_dim, 1024, ROPE_PARAMETERS["default"])
    x, residual = _random((64, hidden), dtype, 11), _random((64, hidden), dtype, 12)
    gate_up = _random((64, 2 * 1536), dtype, 13)
    query, key, _ = _qkv_views(64, head_dim, dtype, seed=14)
    positions = torch.randint(0, 1024, (64,), generator=torch.Generator().manual_seed(15))
    threads = torch.get_num_threads()
    results = []
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            _row_by_row_equals_batch(norm.forward_cpu, x)
            # x and residual side by side, so that a row of the batch carries its own residual.
            _row_by_row_equals_batch(lambda rows: norm.forward_cpu(rows[:, :hidden], rows[:, hidden:])[0],
                                     torch.cat([x, residual], dim=-1))
            _row_by_row_equals_batch(activation.forward_cpu, gate_up)
            full = rope.forward_cpu(positions, query, key)
            for row in range(64):
                rope.clear_memo()
                alone = rope.forward_cpu(positions[row:row + 1], query[row:row + 1], key[row:row + 1])
                assert torch.equal(alone[0][0], full[0][row]) and torch.equal(alone[1][0], full[1][row])
            results.append((norm.forward_cpu(x, residual)[0], activation.forward_cpu(gate_up), full[0]))
    finally:
        torch.set_num_threads(threads)
    for one_thread, two_threads in zip(*results):
        assert torch.equal(one_thread, two_threads)


# ---------------------------------------------------------------- when the native path is not taken


def test_inputs_that_do_not_qualify_take_forward_native(monkeypatch) -> None:
    for name in ("rms_norm", "add_rms_norm", "rotary_embedding", "silu_and_mul"):
        monkeypatch.setattr(native_elementwise._Ops, name, None)  # calling one would raise TypeError
    norm = _norm(64, torch.float16)
    x = _random((3, 64), torch.float16, 0)
    torch.testing.assert_close(norm(x), norm.forward_native(x), atol=0, rtol=0)  # float16
    mixed = _norm(64, torch.float32)
    torch.testing.assert_close(mixed(x.to(torch.bfloat16)), mixed.forward_native(x.to(torch.bfloat16)))
    transposed = _random((64, 3), torch.float32, 1).t()  # last dimension not contiguous
    torch.testing.assert_close(mixed(transposed), mixed.forward_native(transposed), atol=0, rtol=0)
    grad_input = _random((3, 64), torch.float32, 2).requires_grad_()
    assert mixed(grad_input).grad_fn is not None  # autograd keeps the differentiable plain ops


def test_build_failure_falls_back_to_forward_native(monkeypatch, caplog) -> None:
    """No compiler (simulated): one warning, the layers run forward_native, results unchanged."""
    def failing_build(level: str) -> None:
        raise RuntimeError("simulated: no C++ compiler")

    monkeypatch.setattr(cpu_native_extension, "_build_and_load", failing_build)
    monkeypatch.setattr(cpu_native_extension, "_state", None)
    monkeypatch.setattr(native_elementwise, "_available", None)
    for name in ("rms_norm", "add_rms_norm", "rotary_embedding", "silu_and_mul"):
        monkeypatch.setattr(native_elementwise._Ops, name, None)
    norm, activation = _norm(64, torch.float32), SiluAndMul()
    rope = get_rope(64, 32, ROPE_PARAMETERS["default"])
    x = _random((3, 64), torch.float32, 0)
    query, key, _ = _qkv_views(3, 64, torch.float32, seed=1)
    with caplog.at_level(logging.WARNING, logger=cpu_native_extension.__name__):
        assert torch.equal(norm(x), norm.forward_native(x))
        assert torch.equal(norm(x, x)[0], norm.forward_native(x, x)[0])
        assert torch.equal(activation(x), activation.forward_native(x))
        assert torch.equal(rope(torch.arange(3), query, key)[0], rope.forward_native(torch.arange(3), query, key)[0])
    assert native_elementwise.native_elementwise_available() is False
    assert sum("simulated: no C++ compiler" in record.getMessage() for record in caplog.records) == 1


# ---------------------------------------------------------------- tracing


def test_fake_implementations_and_torch_compile() -> None:
    """The ops are opaque nodes with shape functions: FakeTensor shapes, and a compiled graph that calls
    them directly (fullgraph) computes the eager results."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    weight = torch.rand(64) + 0.5
    rope = get_rope(64, 32, ROPE_PARAMETERS["default"])
    x, gate_up = _random((5, 64), torch.bfloat16, 0), _random((2, 5, 256), torch.float32, 1)
    query, key, _ = _qkv_views(5, 64, torch.float32, seed=2)
    positions = torch.arange(5)
    weight16 = weight.bfloat16()
    with FakeTensorMode() as mode:
        fake = mode.from_tensor
        assert native_elementwise.rms_norm(fake(x), fake(weight16), 1e-5).shape == (5, 64)
        output, summed = native_elementwise.add_rms_norm(fake(x), fake(x), fake(weight16), 1e-5)
        assert output.shape == summed.shape == (5, 64) and output.dtype == torch.bfloat16
        rotated = native_elementwise.rotary_embedding(fake(positions), fake(query), fake(key),
                                                      fake(rope.cos_sin_cache), 64)
        assert rotated[0].shape == query.shape and rotated[1].shape == key.shape
        assert native_elementwise.silu_and_mul(fake(gate_up)).shape == (2, 5, 128)

    def block(x: torch.Tensor, query: torch.Tensor, key: torch.Tensor, gate_up: torch.Tensor) -> Any:
        normed, summed = native_elementwise.add_rms_norm(x, x, weight, 1e-5)
        return (normed, summed, native_elementwise.rotary_embedding(positions, query, key, rope.cos_sin_cache, 64),
                native_elementwise.silu_and_mul(gate_up))

    x32 = x.float()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)(x32, query, key, gate_up)
    eager = block(x32, query, key, gate_up)
    for actual, expected in zip(torch.utils._pytree.tree_leaves(compiled), torch.utils._pytree.tree_leaves(eager)):
        assert torch.equal(actual, expected)


def test_layers_keep_the_plain_ops_inside_torch_compile(monkeypatch) -> None:
    """Under torch.compile the layers trace forward_native (the fusion passes match its op sequence)."""
    calls = _counting(monkeypatch, "add_rms_norm")
    norm = _norm(64, torch.float32)
    x, residual = _random((4, 64), torch.float32, 0), _random((4, 64), torch.float32, 1)
    compiled = torch.compile(lambda a, b: norm(a, b), backend="eager", fullgraph=True)(x, residual)
    assert calls[0] == 0
    torch.testing.assert_close(compiled[0], norm.forward_native(x, residual)[0], atol=0, rtol=0)
    norm(x, residual)  # eager: the kernel
    assert calls[0] == 1


# ---------------------------------------------------------------- a whole model


def test_benchmark_shaped_llama_greedy_tokens_native_on_and_off(tmp_path, monkeypatch) -> None:
    """The benchmark model's layer shapes (hidden 576, 9/3 heads of 64, intermediate 1536), two layers, float32:
    32 greedy steps give the same tokens and the same logprobs with the native kernels on and off."""
    from tiny_models import build_tiny_model

    from pagedserve import LLM, SamplingParams

    folder = build_tiny_model("llama", tmp_path / "llama", hidden_size=576, num_attention_heads=9,
                              num_key_value_heads=3, head_dim=64, intermediate_size=1536, num_hidden_layers=2,
                              rms_norm_eps=1e-5, rope_theta=100000.0)
    prompts = [[(7 * i + 3 * j) % 500 + 8 for i in range(length)] for j, length in enumerate((5, 17, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=3)

    def generate() -> list[tuple[list[int], list[dict[int, float]]]]:
        llm = LLM(str(folder), dtype="float32", max_model_len=128, num_kv_blocks=64, distributed_executor_backend="uni")
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids),
                 [{token: logprob.logprob for token, logprob in step.items()} for step in o.outputs[0].logprobs])
                for o in outputs]

    calls = {name: _counting(monkeypatch, name) for name in ("add_rms_norm", "rotary_embedding", "silu_and_mul")}
    native = generate()
    assert all(count[0] > 0 for count in calls.values())  # the kernels really ran
    monkeypatch.setattr(native_elementwise, "_available", False)
    plain = generate()
    assert [tokens for tokens, _ in native] == [tokens for tokens, _ in plain]
    assert all(len(tokens) == 32 for tokens, _ in native)
    assert [steps for _, steps in native] == [steps for _, steps in plain]  # bitwise: the same logprobs
