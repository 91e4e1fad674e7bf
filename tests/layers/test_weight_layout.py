"""weight_layout: the oneDNN prepacked linear equals the plain one (unit, several M, with and without
bias), unpacks bit for bit, traces under torch.compile, and leaves engine outputs unchanged."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pagedserve import LLM, SamplingParams
from pagedserve.config.engine import EngineConfig
from pagedserve.layers.amx_linear import amx_linear_available
from pagedserve.layers.linear import (UNQUANTIZED_LINEAR_METHOD, ColumnParallelLinear, MergedColumnParallelLinear,
                                      QKVParallelLinear, ReplicatedLinear, RowParallelLinear)
from pagedserve.layers.weight_layout import (PREPACKED_LINEAR_METHOD, apply_weight_layout, can_prepack_on_cpu,
                                             resolve_weight_layout, restore_plain_layout, weight_layout_of)

pytestmark = pytest.mark.skipif(not can_prepack_on_cpu(), reason="this torch build has no oneDNN")

HIDDEN = 64
# oneDNN packs bf16 weights only with AVX512-BW/VL/DQ or AVX-NE-CONVERT: an AVX2 CPU has the prepacked layout in
# float32 alone (bf16 runs amx_packed's 'avx2' unit there). Tests of bf16 numerics skip there; tests of the layout
# itself run in PREPACK_DTYPE.
NEEDS_BF16_PREPACK = pytest.mark.skipif(not can_prepack_on_cpu(torch.bfloat16),
                                        reason="oneDNN packs no bfloat16 weights on this CPU (AVX2 only)")
PREPACK_DTYPE = torch.bfloat16 if can_prepack_on_cpu(torch.bfloat16) else torch.float32


def _layers(bias: bool, dtype: torch.dtype) -> list[torch.nn.Module]:
    return [
        ReplicatedLinear(HIDDEN, 96, bias=bias, params_dtype=dtype),
        ColumnParallelLinear(HIDDEN, 80, bias=bias, params_dtype=dtype, tp_rank=0, tp_size=1),
        MergedColumnParallelLinear(HIDDEN, [48, 48], bias=bias, params_dtype=dtype, tp_rank=0, tp_size=1),
        QKVParallelLinear(HIDDEN, 16, 4, 2, bias=bias, params_dtype=dtype, tp_rank=0, tp_size=1),
        # tp_rank 1 of 2: no bias is added on this rank (the all-reduce would add it once).
        RowParallelLinear(2 * HIDDEN, HIDDEN, bias=bias, params_dtype=dtype, tp_rank=1, tp_size=2,
                          reduce_results=False),
    ]


def _fill(layer: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=NEEDS_BF16_PREPACK), torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_prepacked_linear_equals_plain(dtype: torch.dtype, bias: bool) -> None:
    for index, layer in enumerate(_layers(bias, dtype)):
        _fill(layer, seed=index)
        inputs = [torch.randn(m, layer.input_size_per_partition, generator=torch.Generator().manual_seed(m),
                              dtype=torch.float32).to(dtype) for m in (1, 3, 16, 64, 257)]
        inputs.append(torch.randn(2, 5, layer.input_size_per_partition).to(dtype))  # a leading batch dim
        inputs.append(torch.randn(layer.input_size_per_partition, 7).to(dtype).t())  # not contiguous
        expected = [layer(x) for x in inputs]
        plain_weight = layer.weight.detach().clone()
        assert apply_weight_layout(layer, "prepacked") == 1
        assert layer.linear_method is PREPACKED_LINEAR_METHOD and layer.weight.is_mkldnn
        assert layer.weight.shape == plain_weight.shape and layer.weight.dtype == dtype
        for x, reference in zip(inputs, expected):
            actual = layer(x)
            assert actual.shape == reference.shape and actual.dtype == dtype
            if dtype == torch.float32:
                torch.testing.assert_close(actual, reference, rtol=1e-5, atol=1e-5)
            else:
                torch.testing.assert_close(actual, reference, rtol=1.6e-2, atol=1e-2)
        # A plain GEMM with the packed weight's unpacked bits gives the same reference.
        assert restore_plain_layout(layer) == 1
        assert layer.linear_method is UNQUANTIZED_LINEAR_METHOD
        assert torch.equal(layer.weight.view(torch.uint8), plain_weight.view(torch.uint8))
        assert torch.equal(layer(inputs[2]), expected[2])


def test_unpacked_layer_loads_weights_again() -> None:
    layer = MergedColumnParallelLinear(HIDDEN, [32, 32], bias=False, params_dtype=PREPACK_DTYPE, tp_rank=0,
                                       tp_size=1)
    _fill(layer, seed=3)
    apply_weight_layout(layer, "prepacked")
    restore_plain_layout(layer)
    gate = torch.randn(32, HIDDEN).to(PREPACK_DTYPE)
    layer.weight.weight_loader(layer.weight, gate, 0)
    assert torch.equal(layer.weight[:32], gate)


def test_layers_whose_weight_is_read_elsewhere_stay_plain() -> None:
    model = torch.nn.Sequential(ReplicatedLinear(HIDDEN, 32, bias=False, params_dtype=PREPACK_DTYPE),
                                ReplicatedLinear(32, 16, bias=False, params_dtype=PREPACK_DTYPE))
    model[1].weight_read_elsewhere = True
    assert apply_weight_layout(model, "prepacked") == 1
    assert weight_layout_of(model) == {"prepacked": 1, "plain": 1}
    assert not model[1].weight.is_mkldnn


def test_resolve_weight_layout_per_platform_dtype_and_mode() -> None:
    # amx_packed where its kernel runs (tests/layers/test_amx_linear.py), else prepacked where oneDNN packs bf16.
    assert resolve_weight_layout("auto", "cpu", torch.bfloat16) == (
        "amx_packed" if amx_linear_available() else "prepacked" if can_prepack_on_cpu(torch.bfloat16) else "plain")
    assert resolve_weight_layout("auto", "cpu", torch.float32) in ("plain", "plain_native")  # native: own tests
    assert resolve_weight_layout("auto", "cuda", torch.bfloat16) == "plain"
    assert resolve_weight_layout("auto", "cpu", torch.bfloat16, batch_invariant=True) == "plain"
    assert resolve_weight_layout("plain", "cpu", torch.bfloat16) == "plain"
    assert resolve_weight_layout("prepacked", "cpu", torch.float32) == "prepacked"
    with pytest.raises(ValueError, match=r"weight_layout='prepacked' is not available for torch.bfloat16 on 'cuda'"):
        resolve_weight_layout("prepacked", "cuda", torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight_layout='prepacked' with batch_invariant=True"):
        resolve_weight_layout("prepacked", "cpu", torch.bfloat16, batch_invariant=True)


def test_prepacking_is_probed_per_dtype() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=dtype), None)
            runs = True
        except RuntimeError:
            runs = False
        assert can_prepack_on_cpu(dtype) is runs


def test_a_layout_the_cpu_cannot_run_names_the_isa_and_what_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve.layers import weight_layout

    monkeypatch.setitem(weight_layout._prepack_probes, torch.bfloat16, False)  # as on an AVX2-only CPU
    with pytest.raises(ValueError) as error:
        resolve_weight_layout("prepacked", "cpu", torch.bfloat16)
    message = str(error.value)
    assert "weight_layout='prepacked'" in message and "CPU ISA" in message and "layouts it can run: ['plain'" in message
    assert resolve_weight_layout("auto", "cpu", torch.bfloat16) != "prepacked"


def test_engine_config_rejects_prepacked_with_batch_invariant(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="weight_layout='prepacked' with batch_invariant=True"):
        EngineConfig.create(tiny_model_dir("llama"), max_model_len=64, num_kv_blocks=8, weight_layout="prepacked",
                            batch_invariant=True)


def test_prepacked_linear_compiles_with_inductor() -> None:
    torch._dynamo.reset()
    layer = QKVParallelLinear(HIDDEN, 16, 4, 2, bias=True, params_dtype=PREPACK_DTYPE, tp_rank=0, tp_size=1)
    _fill(layer, seed=5)
    apply_weight_layout(layer, "prepacked")

    def step(x: torch.Tensor) -> torch.Tensor:
        return F.silu(layer(x)) * 2.0

    compiled = torch.compile(step, backend="inductor", fullgraph=True, dynamic=False)
    for m in (4, 9):
        x = torch.randn(m, HIDDEN).to(PREPACK_DTYPE)
        torch.testing.assert_close(compiled(x), step(x), rtol=1.6e-2, atol=1e-2)


# ---- end to end ---------------------------------------------------------------------------------
NUM_STEPS = 32


def _prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, 400) for _ in range(rng.randint(4, 40))] for _ in range(num)]


def _run(folder: str, dtype: str, weight_layout: str, prompts: list[list[int]]):  # type: ignore[no-untyped-def]
    llm = LLM(folder, dtype=dtype, max_model_len=128, num_kv_blocks=64, weight_layout=weight_layout)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    params = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    results = [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
               for o in outputs]
    return results, model


def test_float32_prepacked_greedy_equals_plain(tiny_model_dir) -> None:
    folder = tiny_model_dir("qwen2")  # q/k/v biases
    prompts = _prompts(4, seed=11)
    plain, _ = _run(folder, "float32", "plain", prompts)
    packed, model = _run(folder, "float32", "prepacked", prompts)
    assert set(weight_layout_of(model)) == {"prepacked"}
    assert [tokens for tokens, _ in packed] == [tokens for tokens, _ in plain]


@NEEDS_BF16_PREPACK
def test_bfloat16_prepacked_logprobs_close_to_plain(tiny_model_dir) -> None:
    from logprobs_check import assert_top_logprobs_close, check_logprobs_close

    folder = tiny_model_dir("llama-tied", dtype=torch.bfloat16)
    prompts = _prompts(4, seed=12)
    plain, _ = _run(folder, "bfloat16", "plain", prompts)
    packed, model = _run(folder, "bfloat16", "prepacked", prompts)
    assert set(weight_layout_of(model)) == {"prepacked"}
    check_logprobs_close(plain, packed, "plain", "prepacked")
    for (plain_tokens, plain_steps), (packed_tokens, packed_steps) in zip(plain, packed):
        for step, (expected, actual) in enumerate(zip(plain_steps, packed_steps)):
            if plain_tokens[:step + 1] != packed_tokens[:step + 1]:
                break  # the sequences diverged (allowed within the top logprobs, checked above)
            assert_top_logprobs_close(expected, actual, atol=0.05)


def test_inductor_compiled_engine_with_prepacked_weights_equals_eager_plain(tiny_model_dir, tmp_path) -> None:
    """The packed GEMM inside graph capture (pagedserve::prepacked_linear in the inductor graph)."""
    folder = tiny_model_dir("llama")
    rng = random.Random(13)
    prompts = [[rng.randrange(8, 400) for _ in range(rng.randint(3, 12))] for _ in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True)
    common = dict(dtype="float32", max_model_len=128, num_kv_blocks=64, max_num_batched_tokens=64)

    def generate(llm: LLM) -> list[list[int]]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]

    expected = generate(LLM(folder, weight_layout="plain", enforce_eager=True, **common))
    compiled = LLM(folder, weight_layout="prepacked", **common, compilation_config={
        "mode": "compile", "backend": "inductor", "cudagraph_capture_sizes": [4], "cache_dir": str(tmp_path)})
    runner = compiled.llm_engine.engine_core.executor.worker.model_runner
    assert runner.forward.is_compiled and set(weight_layout_of(runner.model)) == {"prepacked"}
    assert generate(compiled) == expected


# ---- the LM head ---------------------------------------------------------------------------------
def _lm_head(vocab: int, dtype: torch.dtype, bias: bool = False):  # type: ignore[no-untyped-def]
    from pagedserve.layers.embedding import ParallelLMHead

    head = ParallelLMHead(vocab, HIDDEN, bias=bias, params_dtype=dtype, tp_rank=0, tp_size=1)
    _fill(head, seed=vocab)
    return head


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=NEEDS_BF16_PREPACK), torch.float32])
@pytest.mark.parametrize("tied", [True, False])
def test_prepacked_lm_head_equals_plain_and_restores(dtype: torch.dtype, tied: bool) -> None:
    from pagedserve.layers.embedding import VocabParallelEmbedding

    head = _lm_head(1000, dtype, bias=not tied)  # vocab 1000 -> 1024 rows with padding
    embedding = VocabParallelEmbedding(1000, HIDDEN, params_dtype=dtype, tp_rank=0, tp_size=1)
    if tied:
        _fill(embedding, seed=4)
        head.tie_weights(embedding)
    model = torch.nn.ModuleDict({"embed_tokens": embedding, "lm_head": head})
    inputs = [torch.randn(m, HIDDEN, generator=torch.Generator().manual_seed(m)).to(dtype) for m in (1, 5, 64)]
    expected = [head.compute_logits(x, dtype=None) for x in inputs]
    plain_weight = head.weight.detach().clone()

    assert apply_weight_layout(model, "prepacked") == 1
    assert head.packed_weight is not None and head.packed_weight.is_mkldnn
    # Tied: the embedding keeps reading its plain table (a packed copy); untied: one packed tensor.
    assert head.weight.is_mkldnn is (not tied)
    assert (head.weight is embedding.weight) is tied
    for x, reference in zip(inputs, expected):
        actual = head.compute_logits(x, dtype=None)
        assert actual.shape == reference.shape == (x.shape[0], 1000) and actual.dtype == dtype
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(actual, reference, rtol=tolerance, atol=tolerance)
    if tied:
        ids = torch.tensor([0, 7, 999])
        assert torch.equal(embedding(ids), plain_weight[ids])

    assert restore_plain_layout(model) == 1
    assert head.packed_weight is None and not head.weight.is_mkldnn
    assert torch.equal(head.weight.view(torch.uint8), plain_weight.view(torch.uint8))
    assert torch.equal(head.compute_logits(inputs[1], dtype=None), expected[1])
    if not tied:  # the restored plain parameter loads a checkpoint again
        table = torch.randn(1000, HIDDEN).to(dtype)
        head.weight.weight_loader(head.weight, table)
        assert torch.equal(head.weight[:1000], table)


@pytest.mark.skipif(not (amx_linear_available() or can_prepack_on_cpu(torch.bfloat16)),
                    reason="no packed bfloat16 layout runs on this CPU")
def test_engine_lm_head_is_prepacked_in_bfloat16_only(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama-tied", dtype=torch.bfloat16)
    for dtype, packed in (("bfloat16", True), ("float32", False)):
        llm = LLM(folder, dtype=dtype, max_model_len=64, num_kv_blocks=16)
        model = llm.llm_engine.engine_core.executor.worker.model_runner.model
        assert (model.lm_head.packed_weight is not None) is packed
        assert model.lm_head.weight is model.model.embed_tokens.weight
