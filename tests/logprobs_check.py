"""Output comparisons with vLLM's semantics (tests/models/utils.py there)."""
from __future__ import annotations

from typing import Sequence

TokensLogprobs = tuple[list[int], Sequence[dict[int, float]]]


def check_outputs_equal(expected: list[list[int]], actual: list[list[int]], name_0: str = "hf",
                        name_1: str = "pagedserve") -> None:
    assert len(expected) == len(actual)
    for index, (a, b) in enumerate(zip(expected, actual)):
        assert a == b, f"prompt {index}: {name_0} {a} != {name_1} {b}"


def check_logprobs_close(outputs_0: list[TokensLogprobs], outputs_1: list[TokensLogprobs],
                         name_0: str = "hf", name_1: str = "pagedserve") -> None:
    """Walk each pair of outputs; at the first differing token each side's token must be in the
    other side's top-N logprobs, after which the sequences diverge and comparison stops."""
    assert len(outputs_0) == len(outputs_1)
    for prompt_index, ((tokens_0, logprobs_0), (tokens_1, logprobs_1)) in enumerate(zip(outputs_0, outputs_1)):
        for step, (token_0, token_1) in enumerate(zip(tokens_0, tokens_1)):
            if token_0 == token_1:
                continue
            assert token_0 in logprobs_1[step], (
                f"prompt {prompt_index} step {step}: {name_0} token {token_0} not in {name_1} top logprobs "
                f"{logprobs_1[step]}")
            assert token_1 in logprobs_0[step], (
                f"prompt {prompt_index} step {step}: {name_1} token {token_1} not in {name_0} top logprobs "
                f"{logprobs_0[step]}")
            break


def assert_top_logprobs_close(expected: dict[int, float], actual: dict[int, float], atol: float) -> None:
    """Same top-N token set (ignoring ties at the boundary) and values within atol."""
    for token_id, value in expected.items():
        if token_id in actual:
            assert abs(actual[token_id] - value) <= atol, (token_id, value, actual[token_id])
    common = set(expected) & set(actual)
    assert len(common) >= len(expected) - 1, (expected, actual)
