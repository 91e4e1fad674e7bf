"""first_argmax (sample/greedy.py) picks exactly what max(dim=-1).indices picks: ties, NaN, -inf, tails.

Every test that takes the `two_level_only` fixture runs twice: on the native CPU kernel (float32 and bfloat16;
other dtypes take the two-level form there too) and on the two-level form alone."""
from __future__ import annotations

import pytest
import torch

from pagedserve.sample import greedy
from pagedserve.sample.greedy import BLOCK_WIDTH, MIN_TWO_LEVEL_ELEMENTS, first_argmax, reference_first_argmax
from pagedserve.sample.sampler import random_sample
from pagedserve.sample.sampling_metadata import build_sampling_metadata
from pagedserve.sampling_params import SamplingParams

# Vocabularies with and without a partial last block (49152 = 48 blocks; the others end in a tail).
VOCAB_SIZES = [49152, 32000, 151936, 2 * BLOCK_WIDTH + 1]


@pytest.fixture(params=["native", "two_level"])
def two_level_only(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail if first_argmax falls back to the one-pass reference: the tests below must exercise the vectorised
    paths. 'native': float32 / bfloat16 must take the native kernel; 'two_level': the native kernel is off."""
    def refuse(logits: torch.Tensor) -> torch.Tensor:
        raise AssertionError(f"first_argmax took the one-pass path for shape {tuple(logits.shape)}")

    monkeypatch.setattr(greedy, "reference_first_argmax", refuse)
    if request.param == "two_level":
        monkeypatch.setattr(greedy, "_native_op", False)
        return
    if not greedy.native_first_argmax_op():
        pytest.skip("the native CPU kernels do not build here")
    two_level = greedy.two_level_first_argmax

    def two_level_unless_native(logits: torch.Tensor) -> torch.Tensor:
        assert logits.dtype not in greedy.NATIVE_DTYPES, "float32 / bfloat16 logits missed the native kernel"
        return two_level(logits)

    monkeypatch.setattr(greedy, "two_level_first_argmax", two_level_unless_native)


def _rows(vocab_size: int) -> int:
    return max(3, -(-MIN_TWO_LEVEL_ELEMENTS // vocab_size))


@pytest.mark.parametrize("vocab_size", VOCAB_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_logits_match_reference(vocab_size: int, dtype: torch.dtype, two_level_only: None) -> None:
    logits = torch.randn(_rows(vocab_size), vocab_size, generator=torch.Generator().manual_seed(vocab_size))
    logits = logits.to(dtype)
    expected = logits.max(dim=-1).indices
    assert torch.equal(first_argmax(logits), expected)


@pytest.mark.parametrize("vocab_size", VOCAB_SIZES)
def test_ties_resolve_to_the_first_index(vocab_size: int, two_level_only: None) -> None:
    generator = torch.Generator().manual_seed(1)
    rows = _rows(vocab_size)
    # Few distinct values: every row holds its maximum many times, across many blocks.
    logits = torch.randint(0, 4, (rows, vocab_size), generator=generator).to(torch.bfloat16)
    assert torch.equal(first_argmax(logits), logits.max(dim=-1).indices)
    # The maximum twice: in a later block first written, the earlier one must win; and within one block.
    logits = torch.zeros(rows, vocab_size)
    logits[0, [vocab_size - 1, BLOCK_WIDTH + 5]] = 1.0
    logits[1, [BLOCK_WIDTH - 1, BLOCK_WIDTH]] = 1.0
    logits[2, [3, 7]] = 1.0
    assert first_argmax(logits)[:3].tolist() == [BLOCK_WIDTH + 5, BLOCK_WIDTH - 1, 3]
    assert torch.equal(first_argmax(logits), logits.max(dim=-1).indices)


@pytest.mark.parametrize("vocab_size", VOCAB_SIZES)
def test_nan_and_infinities_match_reference(vocab_size: int, two_level_only: None) -> None:
    rows = max(8, _rows(vocab_size))
    logits = torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(2))
    logits[0, vocab_size - 1] = float("nan")  # NaN in the last column (the tail when there is one)
    logits[1, [BLOCK_WIDTH + 3, 2 * BLOCK_WIDTH - 1, 5]] = float("nan")  # several: the first one wins
    logits[2] = float("-inf")  # all -inf: index 0
    logits[3, 17] = float("inf")
    logits[3, vocab_size - 2] = float("inf")
    logits[4] = 0.0  # all equal: index 0
    logits[5, :vocab_size - 1] = float("-inf")  # only the last column is finite
    logits[6, BLOCK_WIDTH] = float("nan")
    logits[6, 0] = float("inf")  # NaN beats +inf, as in torch.max
    expected = logits.max(dim=-1).indices
    result = first_argmax(logits)
    assert torch.equal(result, expected)
    assert result[:7].tolist() == [vocab_size - 1, 5, 0, 17, 0, vocab_size - 1, BLOCK_WIDTH]


def test_row_strided_input_matches_reference(two_level_only: None) -> None:
    # A view of the real columns of padded logits: rows are strided, columns contiguous.
    padded = torch.randn(_rows(32000), 32064, generator=torch.Generator().manual_seed(3))
    logits = padded[:, :32000]
    assert not logits.is_contiguous()
    assert torch.equal(first_argmax(logits), logits.max(dim=-1).indices)


@pytest.mark.parametrize("shape", [(1, 1000), (4, BLOCK_WIDTH), (2, 3 * BLOCK_WIDTH), (1, 1)])
def test_small_inputs_take_the_reference(shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(4))
    expected = reference_first_argmax(logits)
    assert torch.equal(first_argmax(logits), expected)  # the native kernel where it is built
    monkeypatch.setattr(greedy, "_native_op", False)
    assert torch.equal(first_argmax(logits), expected)


@pytest.mark.parametrize("vocab_size", [1, 15, 16, 17, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_row_lengths_and_errors(vocab_size: int, dtype: torch.dtype) -> None:
    """Rows shorter than, equal to and just past one 16-lane vector, with the maximum and a NaN in the tail."""
    op = greedy.native_first_argmax_op()
    if not op:
        pytest.skip("the native CPU kernels do not build here")
    logits = torch.randn(6, vocab_size, generator=torch.Generator().manual_seed(vocab_size)).to(dtype)
    logits[1, -1] = 50.0
    logits[2, -1] = float("nan")
    logits[3] = float("-inf")
    logits[4] = -0.0
    logits[4, -1] = 0.0  # -0.0 == 0.0: the first column wins, as in torch.max
    assert torch.equal(op(logits), logits.max(dim=-1).indices)
    with pytest.raises(RuntimeError, match="vocabulary dimension is empty"):
        op(torch.empty(2, 0))
    with pytest.raises(RuntimeError, match="2-D float32 or bfloat16"):
        op(torch.zeros(2, 3, dtype=torch.float16))


def test_sampler_greedy_uses_first_argmax_at_full_vocabulary(sample, two_level_only: None) -> None:
    vocab_size = 49152
    logits = torch.randn(8, vocab_size, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).float()
    sampled = sample(logits, [SamplingParams(temperature=0.0)] * 8).sampled_token_ids
    assert torch.equal(sampled, logits.max(dim=-1).indices)


def test_exponential_race_picks_the_same_token_as_one_pass_max(two_level_only: None) -> None:
    """random_sample's race with seeded generators: the same tokens as the one-pass max over probs / noise."""
    vocab_size, rows = 32000, 12
    probs = torch.softmax(torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(6)), dim=-1)
    params = [SamplingParams(temperature=1.0, seed=100 + row) for row in range(rows)]

    def generators() -> list[torch.Generator | None]:
        return [torch.Generator().manual_seed(100 + row) for row in range(rows)]

    metadata = build_sampling_metadata(params, [[]] * rows, [[]] * rows, generators(), vocab_size,
                                       torch.device("cpu"))
    sampled = random_sample(probs.clone(), metadata)
    noise = torch.empty(rows, vocab_size)
    for row, generator in enumerate(generators()):
        noise[row].uniform_(generator=generator)
    expected = (probs / noise.log_().neg_()).max(dim=-1).indices
    assert torch.equal(sampled, expected)
