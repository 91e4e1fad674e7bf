"""NgramProposer: the longest matching suffix, its most recent earlier occurrence, the tokens after it."""
from __future__ import annotations

import numpy as np
import pytest

from pagedserve.spec_decode.ngram_proposer import NgramProposer


def _propose(tokens: list[int], k: int, lookup_min: int = 1, lookup_max: int = 3) -> list[int]:
    return NgramProposer(lookup_min, lookup_max).propose_one(np.array(tokens, dtype=np.int64), k).tolist()


def test_longest_suffix_wins_and_the_most_recent_occurrence_is_used() -> None:
    # Suffix [1, 2, 3] occurs at 0 (followed by 9) and the 1-gram [3] at 6 (followed by 7): the 3-gram wins.
    assert _propose([1, 2, 3, 9, 8, 5, 3, 7, 1, 2, 3], 2) == [9, 8]
    # Two occurrences of [4, 5]: the later one (followed by 7, 7) proposes.
    assert _propose([4, 5, 6, 6, 4, 5, 7, 7, 4, 5], 3, lookup_max=2) == [7, 7, 4]


def test_no_match_or_too_short_proposes_nothing() -> None:
    assert _propose([1, 2, 3, 4], 3) == []
    assert _propose([5], 3) == []
    assert _propose([1, 2, 1, 2], 0) == []
    # prompt_lookup_min=2: a single repeated token is not enough.
    assert _propose([1, 9, 8, 1], 2, lookup_min=2) == []


def test_proposals_stop_at_the_end_of_the_tokens() -> None:
    # [7] occurs at index 2 followed by only one token before the suffix itself.
    assert _propose([1, 2, 7, 3, 7], 4, lookup_max=1) == [3, 7]


def test_a_repeating_sequence_is_continued() -> None:
    period = [3, 1, 4, 1, 5]
    tokens = period * 3 + period[:2]
    assert _propose(tokens, 5) == (period * 2)[2:7]


def test_bad_bounds() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min=3"):
        NgramProposer(3, 2)
