"""weight_layout='amx_packed': the native tile-packed bfloat16 linear, on each product unit this CPU has (AMX tiles,
AVX512-BF16 dot products, AVX-512 FMA, AVX2 FMA), against a float64 reference, batch and thread invariance, the units
against each other, the FMA units' summation order and subnormals, the pack/unpack round trip, the layout transform
on linear layers and LM heads, torch.compile, and the engine's logprobs against the plain layout."""
from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from pagedserve import LLM, SamplingParams
from pagedserve.layers import amx_linear as amx_module
from pagedserve.layers.amx_linear import (AMX_PACKED_LINEAR_METHOD, amx_linear, amx_linear_available,
                                          amx_linear_products, amx_pack, amx_unpack)
from pagedserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.linear import (UNQUANTIZED_LINEAR_METHOD, MergedColumnParallelLinear, QKVParallelLinear,
                                      ReplicatedLinear, RowParallelLinear)
from pagedserve.layers.weight_layout import (apply_weight_layout, resolve_weight_layout, restore_plain_layout,
                                             weight_layout_of)

pytestmark = pytest.mark.skipif(not amx_linear_available(),
                                reason="no product unit here (CPU without AVX2, or the native kernels are not "
                                       "built)")

BF16 = torch.bfloat16


def _random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def _assert_matches_reference(actual: torch.Tensor, reference: torch.Tensor) -> None:
    # fp32 accumulation then one rounding to bf16: within one bf16 ulp of the exact result (2^-7 relative),
    # plus the fp32 accumulation error over K.
    error = (actual.double() - reference).abs()
    assert bool((error <= reference.abs() * 2.0 ** -7 + 1e-3).all()), f"max error {error.max().item()}"


@contextlib.contextmanager
def _num_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to `count` inside the block, restored after (failures included)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# ---- the kernel ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n, k", [(576, 576), (192, 576), (100, 70), (16, 32), (1000, 1536), (17, 33)])
def test_pack_unpack_round_trip_is_bitwise(n: int, k: int) -> None:
    weight = _random(n, k, seed=n + k)
    packed = amx_pack(weight)
    assert packed.dim() == 1 and packed.numel() == -(-n // 16) * 16 * -(-k // 32) * 32
    assert torch.equal(amx_unpack(packed, n, k).view(torch.int16), weight.view(torch.int16))


@pytest.mark.parametrize("m", [1, 3, 16, 17, 32, 33, 64, 300])
@pytest.mark.parametrize("n, k, has_bias", [(576, 576, False), (192, 576, True), (100, 70, True),
                                            (200, 1536, False)])
def test_amx_linear_matches_float64_reference(linear_products: str, m: int, n: int, k: int, has_bias: bool) -> None:
    weight, x = _random(n, k, seed=1), _random(m, k, seed=m)
    bias = _random(n, seed=2) if has_bias else None
    actual = amx_linear(x, amx_pack(weight), bias, n, linear_products)
    assert actual.shape == (m, n) and actual.dtype == BF16
    _assert_matches_reference(actual, _reference(x, weight, bias))


def test_a_row_is_the_same_in_any_batch_and_thread_count(linear_products: str) -> None:
    """Row blocks (16 rows and pairs of 32 on AMX, 6-12 on the dot products, 1-8 on AVX-512 FMA, 1-5 on AVX2),
    chunks of 256 and the
    thread split all leave a row's bits unchanged."""
    n, k = 200, 576
    weight, bias = _random(n, k, seed=3), _random(n, seed=4)
    packed = amx_pack(weight)
    x = _random(300, k, seed=5)
    full = amx_linear(x, packed, bias, n, linear_products)
    for num_threads in {1, torch.get_num_threads()}:
        with _num_threads(num_threads):
            for start, size in ((0, 1), (7, 9), (31, 2), (40, 33), (250, 50), (299, 1)):
                part = amx_linear(x[start:start + size].contiguous(), packed, bias, n, linear_products)
                assert torch.equal(part.view(torch.int16), full[start:start + size].view(torch.int16))


@pytest.mark.parametrize("n", [50, 64, 120, 192, 576, 1000, 3088])
def test_one_row_streams_equal_the_row_in_a_batch(linear_products: str, n: int) -> None:
    """One row streams a thread's whole groups in up to six stretches at once (interleaved line by line), the partial
    groups at the share's ends one by one: from one group (64; 50 and 120 end inside a whole group's last block) to
    48 and a partial one (3088), on 1-3 threads, its bits are those of the same row in a 7-row batch (register
    blocks, no streams); so are those of 2 and 3 rows (two streams of whole groups) and of 4 rows (one group at a
    time), which read the weights block by block. (The dot products' case; the FMA units run 1-4 rows group by group
    in register blocks of their own size, which must give the same bits too.)"""
    k = 576
    weight, bias = _random(n, k, seed=31), _random(n, seed=32)
    packed = amx_pack(weight)
    x = _random(7, k, seed=33)
    batch = amx_linear(x, packed, bias, n, linear_products)
    for num_threads in (1, 2, 3):
        with _num_threads(num_threads):
            for row in (0, 6):
                one = amx_linear(x[row:row + 1], packed, bias, n, linear_products)
                assert torch.equal(one.view(torch.int16), batch[row:row + 1].view(torch.int16)), (num_threads, row)
            for size in (2, 3, 4):  # one pass over the weights, block by block (dot products)
                few = amx_linear(x[1:1 + size], packed, bias, n, linear_products)
                assert torch.equal(few.view(torch.int16), batch[1:1 + size].view(torch.int16)), (num_threads, size)
    _assert_matches_reference(batch, _reference(x, weight, bias))


def test_few_rows_equal_their_rows_in_a_batch_on_random_shapes(linear_products: str) -> None:
    """Random widths and depths (any number of whole and partial groups, K tails), biases or not, 1-3 threads: 1-4
    rows (streamed or block by block) equal the same rows of a 9-row batch, bit for bit."""
    generator = random.Random(7)
    for trial in range(24):
        n, k = generator.randint(1, 3200), generator.randint(1, 700)
        packed = amx_pack(_random(n, k, seed=trial))
        bias = _random(n, seed=100 + trial) if trial % 2 else None
        x = _random(9, k, seed=200 + trial)
        with _num_threads(generator.choice([1, 2, 3])):
            batch = amx_linear(x, packed, bias, n, linear_products)
            for size in (1, 2, 3, 4):
                start = generator.randint(0, 9 - size)
                few = amx_linear(x[start:start + size], packed, bias, n, linear_products)
                assert torch.equal(few.view(torch.int16), batch[start:start + size].view(torch.int16)), (n, k, size)


@pytest.mark.parametrize("n, k", [(3088, 576), (1000, 1536)])
def test_paneled_prefill_sizes_match_reference_and_small_batches(linear_products: str, n: int, k: int) -> None:
    """Above 256 rows the kernel cuts the weight into L2-sized panels and x into chunks of 32 rows (AMX, AVX-512 FMA),
    35 (AVX2) or 36 (dot products): 3088 x 576 makes six panels of 8 groups and a seventh holding the last, one-block group; 1000 x 1536
    five of 3 groups and a sixth with the last, three-block group; 600 rows end in a 16- and an 8-row tail (AMX) or
    a 24-row chunk (dot products). Each row equals the reference and, bit for bit, the same row computed in a batch
    of <= 256 rows (one chunk, no panels)."""
    weight, bias = _random(n, k, seed=11), _random(n, seed=12)
    packed = amx_pack(weight)
    x = _random(600, k, seed=13)
    full = amx_linear(x, packed, bias, n, linear_products)
    _assert_matches_reference(full, _reference(x, weight, bias))
    for num_threads in {1, torch.get_num_threads()}:
        with _num_threads(num_threads):
            assert torch.equal(amx_linear(x[:297], packed, bias, n, linear_products).view(torch.int16),
                               full[:297].view(torch.int16))
            for start in (0, 256, 512, 576):
                part = amx_linear(x[start:start + 24].contiguous(), packed, bias, n, linear_products)
                assert torch.equal(part.view(torch.int16), full[start:start + 24].view(torch.int16))


def test_leading_dims_and_strided_rows(linear_products: str) -> None:
    n, k = 64, 96
    weight = _random(n, k, seed=6)
    packed = amx_pack(weight)

    def linear(x: torch.Tensor) -> torch.Tensor:
        return amx_linear(x, packed, None, n, linear_products)

    x = _random(2, 5, k, seed=7)
    assert torch.equal(linear(x), linear(x.reshape(10, k)).view(2, 5, n))
    strided = _random(k, 6, seed=8).t()  # column stride != 1
    assert torch.equal(linear(strided), linear(strided.contiguous()))
    wide = _random(4, 2 * k, seed=9)[:, :k]  # row stride 2k, unit column stride: read in place
    assert torch.equal(linear(wide), linear(wide.contiguous()))
    odd = _random(7, k + 1, seed=10)[:, 1:]  # odd row stride, rows at odd element offsets (x pairs unaligned)
    assert torch.equal(linear(odd), linear(odd.contiguous()))


def test_units_agree_where_both_run() -> None:
    """AMX and the dot products sum the same pairs into fp32 in another rounding order, nothing more: few outputs
    differ, each within the reference's tolerance of the other."""
    if len(amx_linear_products()) < 2:
        pytest.skip(f"needs both units (available: {amx_linear_products()})")
    n, k = 576, 576
    weight, bias = _random(n, k, seed=21), _random(n, seed=22)
    packed = amx_pack(weight)
    for m in (1, 40, 300):
        x = _random(m, k, seed=m)
        amx, dot = (amx_linear(x, packed, bias, n, unit) for unit in ("amx", "avx512_bf16"))
        _assert_matches_reference(dot, amx.double())
        assert float((amx.view(torch.int16) != dot.view(torch.int16)).float().mean()) < 0.05


FMA_UNITS = ("avx512", "avx2")


@pytest.fixture(params=FMA_UNITS)
def fma_products(request: pytest.FixtureRequest) -> str:
    """Each FMA unit (bf16 widened to fp32: AVX-512's 16 lanes, AVX2's 8) this build has; the other skips."""
    if request.param not in amx_linear_products():
        pytest.skip(f"needs the {request.param} unit (available: {amx_linear_products()})")
    return request.param


@pytest.mark.parametrize("m, n, k, has_bias", [(3, 100, 70, True), (1, 200, 576, False), (5, 64, 1536, True),
                                               (13, 300, 96, True), (300, 80, 64, False)])
def test_fma_units_sum_k_in_order_as_one_float32_chain(fma_products: str, m: int, n: int, k: int,
                                                       has_bias: bool) -> None:
    """The FMA units' documented numerics, bit for bit (so the AVX-512 and the AVX2 unit agree bit for bit): per
    output one fp32 sum over k in order (a bf16 x bf16 product is exact in fp32, so an FMA rounds only the sum, as
    this loop's add does), + bias in fp32, rounded to bf16 once (ties to even). 13 and 300 rows take every register
    block size of both units, 300 also the paneled path."""
    weight, x = _random(n, k, seed=k), _random(m, k, seed=m + 1)
    bias = _random(n, seed=5) if has_bias else None
    total = torch.zeros(m, n)
    for index in range(k):
        total = total + x[:, index:index + 1].float() * weight[:, index].float()
    if bias is not None:
        total = total + bias.float()
    actual = amx_linear(x, amx_pack(weight), bias, n, fma_products)
    assert torch.equal(actual.view(torch.int16), total.to(BF16).view(torch.int16))


def test_fma_units_keep_subnormal_outputs(fma_products: str) -> None:
    """Results below the smallest normal float round to bf16 subnormals as c10::BFloat16 rounds them (the
    AVX512-BF16 units' VCVTNEPS2BF16 flushes them to zero; tests above compare those only against tolerances)."""
    n, k = 32, 64
    column = torch.arange(n, dtype=torch.float64)
    weight = torch.zeros(n, k, dtype=BF16)
    weight[:, 0] = 2.0 ** -60
    weight[:, 1] = (column * 2.0 ** -66).to(BF16)
    weight[:, 2] = ((column % 4) * 2.0 ** -70).to(BF16)
    x = torch.zeros(2, k, dtype=BF16)
    x[:, 0], x[:, 1], x[:, 2] = 2.0 ** -70, 2.0 ** -67, 2.0 ** -65
    # Column j: (8 + j + (j % 4) / 4) x 2^-133, below 2^-126; 2^-133 is the bf16 subnormals' spacing, so the quarters
    # round down, to even and up. Exact in fp32 (and float64); rounded once to bf16 here.
    expected = (x.double() @ weight.double().T).float().to(BF16)
    assert bool((expected != 0).all()) and bool((expected.float().abs() < torch.finfo(torch.float32).tiny).all())
    actual = amx_linear(x, amx_pack(weight), None, n, fma_products)
    assert torch.equal(actual.view(torch.int16), expected.view(torch.int16))


def test_products_argument_is_checked() -> None:
    packed = amx_pack(_random(32, 64, seed=10))
    x = _random(2, 64, seed=11)
    # One build has one unit besides AMX: the dot products, the AVX-512 FMA or the AVX2 FMA.
    assert amx_linear_products() in (["amx", "avx512_bf16"], ["avx512_bf16"], ["avx512"], ["avx2"])
    assert torch.equal(amx_linear(x, packed, None, 32), amx_linear(x, packed, None, 32, amx_linear_products()[0]))
    with pytest.raises(RuntimeError,
                       match=r"products must be 'auto', 'amx', 'avx512_bf16', 'avx512' or 'avx2', got 'tiles'"):
        amx_linear(x, packed, None, 32, "tiles")
    for unit in {"amx", "avx512_bf16", "avx512", "avx2"} - set(amx_linear_products()):
        with pytest.raises(RuntimeError, match=rf"products='{unit}' is not available in this build or process"):
            amx_linear(x, packed, None, 32, unit)


def test_bad_arguments_raise_clear_errors() -> None:
    packed = amx_pack(_random(32, 64, seed=10))
    with pytest.raises(RuntimeError, match=r"amx_linear: x \[M, K\] bfloat16"):
        torch.ops.pagedserve.amx_linear(torch.randn(2, 64), packed, None, 32)
    with pytest.raises(RuntimeError, match=r"packed weight holds 2048 values; \[32, 96\] packs to 3072"):
        torch.ops.pagedserve.amx_linear(_random(2, 96, seed=11), packed, None, 32)
    with pytest.raises(RuntimeError, match=r"a contiguous 1-D bfloat16 tensor from amx_pack_weight expected"):
        torch.ops.pagedserve.amx_linear(_random(2, 64, seed=12), torch.cat([packed, packed])[::2], None, 32)
    with pytest.raises(RuntimeError, match=r"a bias of 32 values expected"):
        torch.ops.pagedserve.amx_linear(_random(2, 64, seed=12), packed, _random(31, seed=1), 32)
    with pytest.raises(RuntimeError, match=r"amx_pack_weight: a 2-D bfloat16 weight"):
        torch.ops.pagedserve.amx_pack_weight(torch.randn(32, 64))


# ---- the layout on layers ------------------------------------------------------------------------
def _layers() -> list[torch.nn.Module]:
    hidden = 96
    return [
        ReplicatedLinear(hidden, 80, bias=True, params_dtype=BF16),
        MergedColumnParallelLinear(hidden, [48, 48], bias=False, params_dtype=BF16, tp_rank=0, tp_size=1),
        QKVParallelLinear(hidden, 16, 4, 2, bias=True, params_dtype=BF16, tp_rank=0, tp_size=1),
        # tp_rank 1 of 2: no bias is added on this rank (the all-reduce would add it once).
        RowParallelLinear(2 * hidden, hidden, bias=True, params_dtype=BF16, tp_rank=1, tp_size=2,
                          reduce_results=False),
    ]


@pytest.mark.parametrize("index", range(4))
def test_layout_packs_computes_and_restores_bit_for_bit(index: int) -> None:
    layer = _layers()[index]
    with torch.no_grad():
        for seed, param in enumerate(layer.parameters()):
            param.copy_(_random(*param.shape, seed=seed) / param.shape[-1] ** 0.5)
    plain_weight = layer.weight.detach().clone()
    inputs = [_random(m, layer.input_size_per_partition, seed=m) for m in (1, 5, 40)]
    expected = [layer(x) for x in inputs]
    assert apply_weight_layout(layer, "amx_packed") == 1
    assert layer.linear_method is AMX_PACKED_LINEAR_METHOD and layer.weight.dim() == 1
    assert weight_layout_of(layer) == {"amx_packed": 1}
    for x, reference in zip(inputs, expected):
        torch.testing.assert_close(layer(x), reference, rtol=1.6e-2, atol=1e-2)
    assert restore_plain_layout(layer) == 1
    assert layer.linear_method is UNQUANTIZED_LINEAR_METHOD
    assert torch.equal(layer.weight.view(torch.int16), plain_weight.view(torch.int16))
    assert torch.equal(layer(inputs[0]), expected[0])
    if isinstance(layer, MergedColumnParallelLinear):  # the restored parameter loads a checkpoint again
        gate = _random(48, layer.input_size_per_partition, seed=20)
        layer.weight.weight_loader(layer.weight, gate, 0)
        assert torch.equal(layer.weight[:48], gate)


def test_float32_layers_and_layers_read_elsewhere_stay_plain() -> None:
    model = torch.nn.Sequential(ReplicatedLinear(64, 32, bias=False, params_dtype=BF16),
                                ReplicatedLinear(32, 16, bias=False, params_dtype=BF16),
                                ReplicatedLinear(16, 8, bias=False, params_dtype=torch.float32))
    model[1].weight_read_elsewhere = True
    assert apply_weight_layout(model, "amx_packed") == 1
    assert weight_layout_of(model) == {"amx_packed": 1, "plain": 2}


@pytest.mark.parametrize("tied", [True, False])
def test_lm_head_packs_and_restores(tied: bool) -> None:
    hidden = 64
    head = ParallelLMHead(1000, hidden, bias=not tied, params_dtype=BF16, tp_rank=0, tp_size=1)
    embedding = VocabParallelEmbedding(1000, hidden, params_dtype=BF16, tp_rank=0, tp_size=1)
    with torch.no_grad():
        for seed, param in enumerate(list(head.parameters()) + list(embedding.parameters())):
            param.copy_(_random(*param.shape, seed=30 + seed))
    if tied:
        head.tie_weights(embedding)
    model = torch.nn.ModuleDict({"embed_tokens": embedding, "lm_head": head})
    inputs = [_random(m, hidden, seed=m) for m in (1, 7, 64)]
    expected = [head.compute_logits(x, dtype=None) for x in inputs]
    plain_weight = head.weight.detach().clone()

    assert apply_weight_layout(model, "amx_packed") == 1
    assert head.linear_method is AMX_PACKED_LINEAR_METHOD
    # Tied: a packed copy, the embedding keeps its plain table; untied: the packed tensor replaces the weight.
    assert (head.packed_weight is not None) is tied and (head.weight is embedding.weight) is tied
    assert head.weight.dim() == (2 if tied else 1)
    for x, reference in zip(inputs, expected):
        actual = head.compute_logits(x, dtype=None)
        assert actual.shape == (x.shape[0], 1000)
        torch.testing.assert_close(actual, reference, rtol=1.6e-2, atol=5e-2)
    if tied:
        ids = torch.tensor([0, 7, 999])
        assert torch.equal(embedding(ids), plain_weight[ids])

    assert restore_plain_layout(model) == 1
    assert head.packed_weight is None and head.linear_method is UNQUANTIZED_LINEAR_METHOD
    assert torch.equal(head.weight.view(torch.int16), plain_weight.view(torch.int16))
    assert torch.equal(head.compute_logits(inputs[1], dtype=None), expected[1])


def test_resolve_amx_packed() -> None:
    assert resolve_weight_layout("auto", "cpu", BF16) == "amx_packed"
    assert resolve_weight_layout("amx_packed", "cpu", BF16) == "amx_packed"
    assert resolve_weight_layout("auto", "cpu", BF16, batch_invariant=True) == "plain"
    with pytest.raises(ValueError, match=r"weight_layout='amx_packed' is not available for torch.float32 on 'cpu'"):
        resolve_weight_layout("amx_packed", "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"weight_layout='amx_packed' is not available for torch.bfloat16 on 'cuda'"):
        resolve_weight_layout("amx_packed", "cuda", BF16)
    with pytest.raises(ValueError, match=r"weight_layout='amx_packed' with batch_invariant=True"):
        resolve_weight_layout("amx_packed", "cpu", BF16, batch_invariant=True)


def test_amx_linear_compiles_with_inductor() -> None:
    torch._dynamo.reset()
    layer = QKVParallelLinear(64, 16, 4, 2, bias=True, params_dtype=BF16, tp_rank=0, tp_size=1)
    with torch.no_grad():
        for seed, param in enumerate(layer.parameters()):
            param.copy_(_random(*param.shape, seed=seed) / 8)
    apply_weight_layout(layer, "amx_packed")

    def step(x: torch.Tensor) -> torch.Tensor:
        return F.silu(layer(x)) * 2.0

    compiled = torch.compile(step, backend="inductor", fullgraph=True, dynamic=False)
    for m in (4, 9):
        x = _random(m, 64, seed=m)
        torch.testing.assert_close(compiled(x), step(x), rtol=1.6e-2, atol=1e-2)


# ---- end to end ---------------------------------------------------------------------------------
NUM_STEPS = 32


@pytest.mark.parametrize("model", ["qwen2", "llama-tied"])
def test_bfloat16_engine_logprobs_close_to_plain(tiny_model_dir, model: str, monkeypatch) -> None:
    from logprobs_check import assert_top_logprobs_close, check_logprobs_close

    folder = tiny_model_dir(model, dtype=BF16)
    rng = random.Random(22)
    prompts = [[rng.randrange(8, 400) for _ in range(rng.randint(4, 40))] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True, logprobs=5)

    def run(weight_layout: str):  # type: ignore[no-untyped-def]
        # The modules' path: the native decode stack calls the kernel from C++, unseen by the counter below
        # (tests/models/test_native_decode_stack.py covers it with this layout).
        llm = LLM(folder, dtype="bfloat16", max_model_len=128, num_kv_blocks=64, weight_layout=weight_layout,
                  native_decode_stack=False)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results = [(o.outputs[0].token_ids,
                    [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]) for o in outputs]
        return results, llm.llm_engine.engine_core.executor.worker.model_runner.model

    plain, _ = run("plain")
    calls = []
    real_op = amx_module._linear_op
    monkeypatch.setattr(amx_module, "_linear_op", lambda *args: calls.append(1) or real_op(*args))
    packed, model_packed = run("auto")  # auto = amx_packed for bf16 on a CPU with AMX
    assert set(weight_layout_of(model_packed)) == {"amx_packed"}
    assert model_packed.lm_head.linear_method is AMX_PACKED_LINEAR_METHOD
    assert len(calls) > NUM_STEPS * 4, "prefill and decode must run on the AMX kernel"
    check_logprobs_close(plain, packed, "plain", "amx_packed")
    for (plain_tokens, plain_steps), (packed_tokens, packed_steps) in zip(plain, packed):
        for step, (expected, actual) in enumerate(zip(plain_steps, packed_steps)):
            if plain_tokens[:step + 1] != packed_tokens[:step + 1]:
                break  # the sequences diverged (allowed within the top logprobs, checked above)
            assert_top_logprobs_close(expected, actual, atol=0.05)
