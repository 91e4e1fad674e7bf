"""weight_layout='plain_native': the native small-batch float32 linear against a float64 reference and
F.linear, its batch/thread invariance, errors, fallbacks, layout resolution, and engine outputs."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import pagedserve.layers.small_batch_linear as small_batch_module
from pagedserve import LLM, SamplingParams
from pagedserve.layers.linear import UNQUANTIZED_LINEAR_METHOD, ReplicatedLinear
from pagedserve.layers.small_batch_linear import (MAX_ROWS, SMALL_BATCH_LINEAR_METHOD, qualifies,
                                                  small_batch_linear, small_batch_linear_available)
from pagedserve.layers.weight_layout import (apply_weight_layout, resolve_weight_layout, restore_plain_layout,
                                             weight_layout_of)

pytestmark = pytest.mark.skipif(not small_batch_linear_available(),
                                reason="the native library has no AVX-512 small-batch kernel on this machine")


def _tensor(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("k", [16, 20, 576, 1000])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 577])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_float64_reference_and_f_linear(k: int, n: int, with_bias: bool) -> None:
    weight = _tensor(n, k, seed=n * k) / k ** 0.5
    bias = _tensor(n, seed=7) if with_bias else None
    for m in (1, 2, 3, 4, 5, 8, 13, 16, 17, 64, 128):
        x = _tensor(m, k, seed=m)
        actual = small_batch_linear(x, weight, bias)
        reference = x.double() @ weight.double().t() + (bias.double() if with_bias else 0)
        assert actual.shape == (m, n) and actual.dtype == torch.float32
        torch.testing.assert_close(actual.double(), reference, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(actual, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_strided_rows() -> None:
    weight = _tensor(64, 96, seed=1)
    wide = _tensor(6, 200, seed=2)
    x = wide[:, 50:146]  # rows 200 floats apart, unit column stride
    assert qualifies(x) and not x.is_contiguous()
    torch.testing.assert_close(small_batch_linear(x, weight, None), x @ weight.t(), rtol=1e-5, atol=1e-5)
    for size in (1, 2, 3):  # streamed rows read x at its stride too
        torch.testing.assert_close(small_batch_linear(x[:size], weight, None), x[:size] @ weight.t(), rtol=1e-5,
                                   atol=1e-5)
    assert not qualifies(_tensor(96, 6, seed=3).t())  # column stride 6: F.linear takes it


def test_a_row_is_bitwise_the_same_alone_in_a_batch_and_on_any_thread_count() -> None:
    """One or two rows stream six stretches of weight rows at a time, three rows four, and on AVX2 four rows three
    and five rows as four, then one (301 rows: uneven stretches on 1-3 threads); a batch goes four weight rows at a
    time: a row's bits are the same either way."""
    weight, bias = _tensor(301, 576, seed=4), _tensor(301, seed=6)
    batch = _tensor(MAX_ROWS, 576, seed=5)
    threads = torch.get_num_threads()
    try:
        results = []
        for num_threads in sorted({1, 2, 3, threads}):
            torch.set_num_threads(num_threads)
            results.append(small_batch_linear(batch, weight, bias))
            for row in (0, 7, MAX_ROWS - 1):
                alone = small_batch_linear(batch[row:row + 1], weight, bias)
                assert torch.equal(alone[0], results[-1][row]), (num_threads, row)
            for size in (2, 3, 4, 5):
                few = small_batch_linear(batch[1:1 + size], weight, bias)
                assert torch.equal(few, results[-1][1:1 + size]), (num_threads, size)
        assert all(torch.equal(results[0], result) for result in results[1:])
    finally:
        torch.set_num_threads(threads)


def test_streamed_rows_equal_their_rows_in_a_batch_on_random_shapes() -> None:
    """Random widths and depths (uneven stretches, K tails), biases or not, 1-3 threads: 1-5 streamed rows (AVX2
    streams up to five) equal the same rows of a 9-row batch (four weight rows at a time), bit for bit."""
    generator = random.Random(7)
    threads = torch.get_num_threads()
    try:
        for trial in range(24):
            n, k = generator.randint(1, 3200), generator.randint(1, 700)
            weight, x = _tensor(n, k, seed=trial), _tensor(9, k, seed=100 + trial)
            bias = _tensor(n, seed=200 + trial) if trial % 2 else None
            torch.set_num_threads(generator.choice([1, 2, 3]))
            batch = small_batch_linear(x, weight, bias)
            for size in (1, 2, 3, 4, 5):
                start = generator.randint(0, 9 - size)
                assert torch.equal(small_batch_linear(x[start:start + size], weight, bias),
                                   batch[start:start + size]), (n, k, size)
    finally:
        torch.set_num_threads(threads)


def test_errors_name_the_problem() -> None:
    weight = _tensor(8, 32, seed=6)
    with pytest.raises(RuntimeError, match="M=129 exceeds 128"):
        small_batch_linear(_tensor(129, 32, seed=1), weight, None)
    with pytest.raises(RuntimeError, match="float32 x and weight expected"):
        small_batch_linear(_tensor(2, 32, seed=1).bfloat16(), weight.bfloat16(), None)
    with pytest.raises(RuntimeError, match="x has 31 columns, weight 32"):
        small_batch_linear(_tensor(2, 31, seed=1), weight, None)
    with pytest.raises(RuntimeError, match="a float32 bias of 8 values expected"):
        small_batch_linear(_tensor(2, 32, seed=1), weight, _tensor(7, seed=1))


@pytest.mark.parametrize("is_intel", [True, False], ids=["intel", "other"])
def test_method_uses_the_kernel_for_small_batches_and_a_gemm_above(monkeypatch, is_intel: bool) -> None:
    """Up to 16 rows on the kernel on Intel (MKL above), up to 128 elsewhere (oneDNN above)."""
    monkeypatch.setattr(small_batch_module, "is_intel_cpu", lambda: is_intel)
    layer = ReplicatedLinear(48, 40, bias=True, params_dtype=torch.float32)
    with torch.no_grad():
        layer.weight.copy_(_tensor(40, 48, seed=8))
        layer.bias.copy_(_tensor(40, seed=9))
    calls = []
    real_op = small_batch_module._op
    monkeypatch.setattr(small_batch_module, "_op", lambda *args: calls.append(args[0].shape[0]) or real_op(*args))
    assert apply_weight_layout(layer, "plain_native") == 1
    assert layer.linear_method is SMALL_BATCH_LINEAR_METHOD and weight_layout_of(layer) == {"plain_native": 1}
    for m in (1, 16, 17, 64, 128, 129):
        x = _tensor(m, 48, seed=m)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    three_d = _tensor(2, 3, 48, seed=10)
    assert torch.equal(layer(three_d), F.linear(three_d, layer.weight, layer.bias))
    if is_intel:
        x = _tensor(17, 48, seed=17)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert calls == ([1, 16] if is_intel else [1, 16, 17, 64, 128])
    assert restore_plain_layout(layer) == 1 and layer.linear_method is UNQUANTIZED_LINEAR_METHOD


def test_resolve_plain_native() -> None:
    assert resolve_weight_layout("auto", "cpu", torch.float32) == "plain_native"
    assert resolve_weight_layout("auto", "cpu", torch.float32, batch_invariant=True) == "plain"
    assert resolve_weight_layout("auto", "cpu", torch.bfloat16) != "plain_native"  # a float32 layout
    assert resolve_weight_layout("plain_native", "cpu", torch.float32) == "plain_native"
    with pytest.raises(ValueError, match=r"weight_layout='plain_native' is not available for torch.bfloat16"):
        resolve_weight_layout("plain_native", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight_layout='plain_native' is not available for torch.float32 on 'cuda'"):
        resolve_weight_layout("plain_native", "cuda", torch.float32)
    with pytest.raises(ValueError, match=r"weight_layout='plain_native' with batch_invariant=True"):
        resolve_weight_layout("plain_native", "cpu", torch.float32, batch_invariant=True)
    with pytest.raises(ValueError, match=r"weight_layout='packed' must be one of"):
        resolve_weight_layout("packed", "cpu", torch.float32)


@pytest.mark.parametrize("is_intel", [True, False], ids=["intel", "other"])
def test_large_batches_take_mkl_on_intel_and_onednn_elsewhere(monkeypatch, is_intel: bool) -> None:
    monkeypatch.setattr(small_batch_module, "is_intel_cpu", lambda: is_intel)
    layer = ReplicatedLinear(48, 40, bias=True)
    with torch.no_grad():
        layer.weight.copy_(_tensor(40, 48, seed=3))
        layer.bias.copy_(_tensor(40, seed=4))
    assert apply_weight_layout(layer, "plain_native") == 1
    x = _tensor(MAX_ROWS + 9, 48, seed=5)
    expected = (F.linear(x, layer.weight, layer.bias) if is_intel
                else torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], ""))
    assert small_batch_module.large_batches_on_onednn() is (not is_intel)
    actual = layer(x)
    assert torch.equal(actual, expected)
    torch.testing.assert_close(actual, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_cpu_vendor_id_reads_cpuinfo(tmp_path) -> None:
    from pagedserve.platforms.cpu_vendor import cpu_vendor_id

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n\nprocessor\t: 1\n"
                       "vendor_id\t: AuthenticAMD\n")
    assert cpu_vendor_id(str(cpuinfo)) == "AuthenticAMD"
    cpuinfo.write_text("processor\t: 0\nBogoMIPS\t: 50.00\n")
    assert cpu_vendor_id(str(cpuinfo)) is None
    assert cpu_vendor_id(str(tmp_path / "missing")) is None


NUM_STEPS = 32


@pytest.mark.parametrize("model", ["qwen2", "llama-tied"])
def test_float32_engine_greedy_equals_plain(tiny_model_dir, model: str, monkeypatch) -> None:
    folder = tiny_model_dir(model)
    rng = random.Random(21)
    prompts = [[rng.randrange(8, 400) for _ in range(rng.randint(4, 40))] for _ in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True, logprobs=3)

    def run(weight_layout: str):  # type: ignore[no-untyped-def]
        # The modules' path: the native decode stack calls the kernel from C++, unseen by the counter below
        # (tests/models/test_native_decode_stack.py covers it with this layout).
        llm = LLM(folder, dtype="float32", max_model_len=128, num_kv_blocks=64, weight_layout=weight_layout,
                  native_decode_stack=False)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        model = llm.llm_engine.engine_core.executor.worker.model_runner.model
        return outputs, model

    plain, _ = run("plain")
    calls = []
    real_op = small_batch_module._op
    monkeypatch.setattr(small_batch_module, "_op", lambda *args: calls.append(1) or real_op(*args))
    native, model_native = run("auto")
    assert set(weight_layout_of(model_native)) == {"plain_native"}
    assert model_native.lm_head.linear_method is SMALL_BATCH_LINEAR_METHOD
    assert len(calls) > NUM_STEPS * 4, "decode steps must run on the native kernel"
    for expected, actual in zip(plain, native):
        assert actual.outputs[0].token_ids == expected.outputs[0].token_ids
        for step_expected, step_actual in zip(expected.outputs[0].logprobs, actual.outputs[0].logprobs):
            for token, logprob in step_expected.items():
                assert abs(step_actual[token].logprob - logprob.logprob) < 1e-4
