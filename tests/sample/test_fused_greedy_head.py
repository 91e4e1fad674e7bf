"""sample/fused_greedy_head.py: greedy token ids from the LM head's kernel, bitwise first_argmax of its logits."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.layers.amx_linear import amx_linear, amx_linear_available, amx_pack
from pagedserve.layers.embedding import ParallelLMHead
from pagedserve.layers.weight_layout import apply_weight_layout
from pagedserve.sample import Sampler, fused_greedy_head
from pagedserve.sample.fused_greedy_head import (
    FusedGreedySampler,
    amx_linear_first_argmax,
    fused_op_available,
    head_first_argmax,
)
from pagedserve.sample.greedy import reference_first_argmax
from pagedserve.structured_output.logits_mask import allowed_token_mask

pytestmark = pytest.mark.skipif(not (amx_linear_available() and fused_op_available()),
                                reason="no product unit of the tile-packed kernel here (CPU without AVX2), or "
                                       "the native kernels are not built")

BF16 = torch.bfloat16


def _random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


def _unfused(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, num_columns: int,
             products: str = "auto") -> torch.Tensor:
    return reference_first_argmax(amx_linear(x, packed, bias, n, products)[:, :num_columns])


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("n, k, num_columns, has_bias", [
    (3000, 576, 3000, False),  # several groups per thread, a partial last block
    (1024, 64, 1000, True),  # padding columns past the vocabulary never win
    (200, 40, 130, True),  # K not a multiple of 32; columns cut inside a block
    (64, 32, 64, False),  # one group
])
def test_kernel_is_first_argmax_of_the_linear(linear_products: str, num_threads: int, n: int, k: int,
                                              num_columns: int, has_bias: bool) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        packed = amx_pack(_random(n, k, seed=n) / 8)
        bias = _random(n, seed=k) if has_bias else None
        for m in (1, 2, 3, 5, 16, 33, 64, 257, 300):  # decode-sized chunks, and the paneled path above 256 rows
            x = _random(m, k, seed=m)
            assert torch.equal(amx_linear_first_argmax(x, packed, bias, n, num_columns, linear_products),
                               _unfused(x, packed, bias, n, num_columns, linear_products)), m
            # Integer-valued inputs make equal bf16 logits common: the first of them must win.
            coarse = x.float().mul(4).round().to(BF16)
            assert torch.equal(amx_linear_first_argmax(coarse, packed, bias, n, num_columns, linear_products),
                               _unfused(coarse, packed, bias, n, num_columns, linear_products)), m
    finally:
        torch.set_num_threads(previous)


def test_ties_infinities_and_nan_resolve_as_max_indices() -> None:
    n, k = 300, 64
    zero = amx_pack(torch.zeros(n, k, dtype=BF16))
    x = _random(3, k, seed=1)
    minus_infinity = torch.full((n,), float("-inf"), dtype=BF16)
    # Every logit -inf: index 0, as max(dim=-1) gives.
    assert amx_linear_first_argmax(x, zero, minus_infinity, n, n).tolist() == [0, 0, 0]
    # +inf twice: the first.
    two_peaks = minus_infinity.clone()
    two_peaks[[123, 200]] = float("inf")
    assert amx_linear_first_argmax(x, zero, two_peaks, n, n).tolist() == [123, 123, 123]
    # All equal (zero logits): the first column.
    assert amx_linear_first_argmax(x, zero, None, n, n).tolist() == [0, 0, 0]
    # NaN beats everything, the first NaN wins; past num_columns it does not count.
    weight = _random(n, k, seed=2) / 8
    weight[[250, 7]] = float("nan")
    packed = amx_pack(weight)
    assert amx_linear_first_argmax(x, packed, two_peaks, n, n).tolist() == [7, 7, 7]
    assert torch.equal(amx_linear_first_argmax(x, packed, None, n, n), _unfused(x, packed, None, n, n))
    assert amx_linear_first_argmax(x, packed, two_peaks, n, 7).tolist() == [0, 0, 0]


def _random_words(num_rows: int, num_columns: int, allowed_share: float, seed: int) -> torch.Tensor:
    """int32 bitmask words [num_rows, ceil(num_columns / 32)] allowing about `allowed_share` of the columns."""
    bits = torch.rand(num_rows, (num_columns + 31) // 32 * 32, generator=torch.Generator().manual_seed(seed))
    bits = (bits < allowed_share).to(torch.int64).view(num_rows, -1, 32)
    words = (bits << torch.arange(32)).sum(-1)  # bit j of word w: column 32 w + j
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _masked_unfused(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, num_columns: int,
                    words: torch.Tensor, products: str = "auto") -> torch.Tensor:
    """The logits path: amx_linear's logits, disallowed tokens -inf (logits_mask's reference), first_argmax."""
    logits = amx_linear(x, packed, bias, n, products)[:, :num_columns]
    return reference_first_argmax(logits.masked_fill(~allowed_token_mask(words, num_columns), float("-inf")))


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("allowed_share", [0.002, 0.3, 0.97])
def test_allowed_tokens_pick_as_the_masked_logits(linear_products: str, num_threads: int,
                                                  allowed_share: float) -> None:
    """Structured outputs: with each row's grammar bitmask the pick is the first argmax of the logits with the
    disallowed tokens set to -inf (xgrammar's mask), whatever rows and threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for n, k, num_columns, has_bias in ((3000, 576, 3000, True), (1024, 64, 1000, False), (200, 40, 130, True)):
            packed = amx_pack(_random(n, k, seed=n) / 8)
            bias = _random(n, seed=k) if has_bias else None
            for m in (1, 3, 16, 64, 300):
                x = _random(m, k, seed=m)
                words = _random_words(m, num_columns, allowed_share, seed=m + n)
                fused = amx_linear_first_argmax(x, packed, bias, n, num_columns, linear_products, words)
                assert torch.equal(fused, _masked_unfused(x, packed, bias, n, num_columns, words, linear_products))
                if allowed_share < 0.01:  # the mask moved the pick (a 0.2% chance per row that it would not)
                    assert not torch.equal(fused, _unfused(x, packed, bias, n, num_columns, linear_products))
    finally:
        torch.set_num_threads(previous)


def test_allowed_tokens_edge_cases_and_errors() -> None:
    n, k = 300, 64
    x = _random(3, k, seed=1)
    weight = _random(n, k, seed=2) / 8
    weight[7] = float("nan")  # a NaN logit in column 7
    packed = amx_pack(weight)
    words = torch.zeros(3, (n + 31) // 32, dtype=torch.int32)
    words[0, 0] = 1 << 7  # row 0: only the NaN column: it wins
    words[1, 9] = 1 << 3  # row 1: only column 291
    words[2, :] = -1
    words[2, 0] &= ~(1 << 7)  # row 2: everything but the NaN
    picks = amx_linear_first_argmax(x, packed, None, n, n, "auto", words)
    assert picks[:2].tolist() == [7, 291]
    assert torch.equal(picks, _masked_unfused(x, packed, None, n, n, words))
    # No allowed column at all: every logit counts as -inf and the first column wins, as the masked logits' argmax.
    assert amx_linear_first_argmax(x, packed, None, n, n, "auto", torch.zeros_like(words)).tolist() == [0, 0, 0]
    with pytest.raises(RuntimeError, match=r"allowed has shape \[3, 9\]; expected 3 rows of at least 10 words"):
        amx_linear_first_argmax(x, packed, None, n, n, "auto", words[:, :9].contiguous())
    with pytest.raises(RuntimeError, match="allowed must be a contiguous int32 CPU tensor"):
        amx_linear_first_argmax(x, packed, None, n, n, "auto", words.long())
    with pytest.raises(RuntimeError, match=r"expected 3 rows"):
        amx_linear_first_argmax(x, packed, None, n, n, "auto", words[:2])


def test_bad_arguments_raise_clear_errors() -> None:
    packed = amx_pack(_random(64, 32, seed=3))
    x = _random(2, 32, seed=4)
    with pytest.raises(RuntimeError, match="num_columns=65 must be in \\[1, n=64\\]"):
        amx_linear_first_argmax(x, packed, None, 64, 65)
    with pytest.raises(RuntimeError, match="x \\[M, K\\] bfloat16"):
        amx_linear_first_argmax(x.float(), packed, None, 64, 64)
    with pytest.raises(RuntimeError, match="packs to"):
        amx_linear_first_argmax(x, packed, None, 128, 64)
    with pytest.raises(RuntimeError, match="a bias of 64 values"):
        amx_linear_first_argmax(x, packed, _random(63, seed=5), 64, 64)


def _head(layout: str, vocab: int = 1000, bias: bool = False) -> ParallelLMHead:
    head = ParallelLMHead(vocab, 64, bias=bias, params_dtype=BF16, tp_rank=0, tp_size=1)
    with torch.no_grad():
        for seed, parameter in enumerate(head.parameters()):
            parameter.copy_(_random(*parameter.shape, seed=30 + seed) / 8)
    apply_weight_layout(torch.nn.ModuleDict({"lm_head": head}), layout)
    return head


def test_sampler_seam_answers_only_plain_greedy_batches_on_a_packed_head(make_metadata) -> None:
    head = _head("amx_packed", bias=True)  # vocab 1000: 1024 columns with padding
    model = torch.nn.ModuleDict({"lm_head": head})
    hidden = _random(6, 64, seed=6)
    greedy = [SamplingParams(temperature=0.0)] * 6
    expected = Sampler()(head.compute_logits(hidden, dtype=None), make_metadata(greedy, 1000)).sampled_token_ids

    output = FusedGreedySampler(model, enable_reduce_sample=False)(hidden, make_metadata(greedy, 1000))
    assert output is not None and output.logprobs is None and torch.equal(output.sampled_token_ids, expected)
    # Batches that need the logits for more than the argmax.
    for needs_logits in ([SamplingParams(temperature=0.0, logprobs=2)] + greedy[1:],
                         [SamplingParams(temperature=0.8)] + greedy[1:],
                         [SamplingParams(temperature=0.0, repetition_penalty=1.2)] + greedy[1:],
                         [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5])] + greedy[1:]):
        metadata = make_metadata(needs_logits, 1000, output_token_ids=[[1, 2]] * 6)
        assert FusedGreedySampler(model, enable_reduce_sample=False)(hidden, metadata) is None
    # reduce_sample gathers its own candidates; other layouts have no kernel to fuse into.
    assert FusedGreedySampler(model, enable_reduce_sample=True)(hidden, make_metadata(greedy, 1000)) is None
    assert head_first_argmax(_head("plain"), hidden) is None
    assert head_first_argmax(head, hidden.float()) is None


def test_engine_greedy_tokens_are_the_same_with_and_without_the_fused_head(tiny_model_dir, monkeypatch) -> None:
    """On/off equivalence: 40 greedy steps of a batch of four, identical token ids; a batch asking for logprobs
    keeps the logits path."""
    folder = tiny_model_dir("llama", dtype=BF16)
    prompts = [{"prompt_token_ids": [(5 * i + 11 * j) % 400 + 8 for i in range(20 + 30 * j)]} for j in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results: list[object] = []
    real = fused_greedy_head.head_first_argmax
    monkeypatch.setattr(fused_greedy_head, "head_first_argmax",
                        lambda *args: results.append(real(*args)) or results[-1])
    # The modules take the decode steps: the native stack samples greedy steps with the same kernel itself
    # (tests/models/test_native_decode_stack.py).
    llm = LLM(folder, dtype="bfloat16", max_model_len=256, num_kv_blocks=64, weight_layout="amx_packed",
              native_decode_stack=False)

    def generate(params: SamplingParams) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    fused = generate(greedy)
    assert len(results) >= 40 and all(r is not None for r in results), "the greedy steps did not take the fused head"
    results.clear()
    with_logprobs = generate(SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1))
    assert results == []
    monkeypatch.setattr(FusedGreedySampler, "__call__", lambda self, *args: None)
    assert generate(greedy) == fused == with_logprobs


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("num_rows", [1, 2])
def test_few_row_ties_go_to_the_first_column_whatever_order_the_groups_come_in(num_threads: int,
                                                                              num_rows: int) -> None:
    """Products of 1-3 rows stream groups of 64 columns out of order (stretches interleaved): equal maxima (and NaNs)
    in the same lane, in groups visited in either order, still resolve to the first column."""
    n, k = 1000, 64
    zero = amx_pack(torch.zeros(n, k, dtype=BF16))
    x = _random(num_rows, k, seed=3)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for first in (5, 70, 130, 300, 517):
            for groups_apart in (1, 2, 5, 7):
                second = first + 64 * groups_apart
                if second >= n:
                    continue
                logits = torch.full((n,), -1.0, dtype=BF16)
                logits[[first, second]] = 3.0
                assert amx_linear_first_argmax(x, zero, logits, n, n).tolist() == [first] * num_rows, (first, second)
                weight = torch.zeros(n, k, dtype=BF16)
                weight[[first, second]] = float("nan")
                assert amx_linear_first_argmax(x, amx_pack(weight), None, n, n).tolist() == [first] * num_rows, \
                    (first, second)
    finally:
        torch.set_num_threads(previous)
