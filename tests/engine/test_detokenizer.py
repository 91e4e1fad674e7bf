"""Incremental detokenization, stop strings and streaming holdback on a tiny byte-level BPE tokenizer."""
from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from pagedserve.engine.detokenizer import (
    REPLACEMENT_CHARACTER,
    IncrementalDetokenizer,
    find_stop_string,
    num_stop_prefix_chars,
)
from pagedserve.sampling_params import SamplingParams

TEXTS = [
    "日本語のテキスト。中文文本。",
    "Emoji: 😀 🚀 🎉 👍 ❤️ 🔥 — dashes – and “quotes”",
    "Unicode: café, naïve, über, Straße, smörgåsbord.",
    "한국어 텍스트. Русский текст. Ελληνικά. ∑ x² ≤ ∞",
    "The quick brown fox jumps over the lazy dog.",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir: str):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int], chunk_sizes: list[int] | None = None,
           finish_reason: str | None = "length") -> tuple[list[str], str | None]:
    """Feed tokens in chunks, the last chunk finishing; return the delta texts shown and the stop hit."""
    deltas: list[str] = []
    position = 0
    chunk_index = 0
    while position < len(token_ids):
        size = chunk_sizes[chunk_index % len(chunk_sizes)] if chunk_sizes else 1
        chunk_index += 1
        chunk = token_ids[position:position + size]
        position += size
        is_last = position >= len(token_ids)
        stop = detokenizer.update(chunk, finished=is_last and finish_reason is not None,
                                  stop_terminated=is_last and finish_reason == "stop")
        deltas.append(detokenizer.get_next_output_text(finished=is_last or stop is not None, delta=True))
        if stop is not None:
            return deltas, stop
    return deltas, None


def test_tokenizer_splits_multibyte_characters(tokenizer) -> None:
    # The other tests only mean something if characters really are split across tokens.
    ids = encode(tokenizer, "".join(TEXTS))
    assert any(REPLACEMENT_CHARACTER in tokenizer.decode([token_id]) for token_id in ids)


@pytest.mark.parametrize("chunk_sizes", [[1], [2, 1, 3], [5]])
def test_incremental_equals_full_decode_and_never_emits_replacement(tokenizer, chunk_sizes: list[int]) -> None:
    rng = random.Random(0)
    for _ in range(20):
        text = "".join(rng.sample(TEXTS, 3))
        start = rng.randrange(len(text) // 2)
        text = text[start:start + rng.randrange(5, 60)]
        prompt_ids = tokenizer.encode("Hello 你好")
        output_ids = encode(tokenizer, text)
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
        deltas, _ = stream(detokenizer, output_ids, chunk_sizes)
        assert all(REPLACEMENT_CHARACTER not in delta for delta in deltas), deltas
        assert "".join(deltas) == detokenizer.output_text == tokenizer.decode(output_ids) == text


def test_multibyte_character_is_emitted_once_complete(tokenizer) -> None:
    ids = encode(tokenizer, "😀")
    assert len(ids) >= 2
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"), SamplingParams())
    for token_id in ids[:-1]:
        detokenizer.update([token_id])
        assert detokenizer.get_next_output_text(finished=False, delta=True) == ""
    detokenizer.update(ids[-1:])
    assert detokenizer.get_next_output_text(finished=False, delta=True) == "😀"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_ids_match_full_decode(tokenizer, skip_special_tokens: bool) -> None:
    # Arbitrary ids (raw bytes, invalid UTF-8, special tokens): after the final flush the text equals a
    # full decode of the output ids.
    rng = random.Random(1)
    for _ in range(30):
        output_ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 25))]
        params = SamplingParams(skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=False)
        detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("abc"), params)
        deltas, _ = stream(detokenizer, output_ids, [rng.randrange(1, 4)])
        expected = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == detokenizer.output_text == expected


def test_special_tokens_skipped_or_kept(tokenizer) -> None:
    eos = tokenizer.eos_token_id
    ids = encode(tokenizer, "Hello") + [eos] + encode(tokenizer, "world")
    prompt = tokenizer.encode("Hi")

    def text_for(**kwargs: bool) -> str:
        detokenizer = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(**kwargs))
        deltas, _ = stream(detokenizer, ids)
        return "".join(deltas)

    assert text_for() == "Helloworld"
    assert text_for(skip_special_tokens=False, spaces_between_special_tokens=False) == "Hello</s>world"
    assert text_for(skip_special_tokens=False, spaces_between_special_tokens=True) == "Hello </s> world"


def test_stop_token_text_excluded_unless_included(tokenizer) -> None:
    ids = encode(tokenizer, "Hello") + [tokenizer.eos_token_id]
    kept = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [1], kept)
    stream(detokenizer, ids, finish_reason="stop")
    assert detokenizer.output_text == "Hello"
    included = kept.clone(include_stop_str_in_output=True)
    detokenizer = IncrementalDetokenizer(tokenizer, [1], included)
    stream(detokenizer, ids, finish_reason="stop")
    assert detokenizer.output_text == "Hello</s>"


def test_find_stop_string_rules() -> None:
    # Only matches ending after check_from count; one may start before it.
    assert find_stop_string("abcdef", 4, ["cde"], False).truncate_to == 2
    assert find_stop_string("abcdef", 5, ["cde"], False) is None
    # Earliest completion wins, then earliest start; include puts the cut after the stop string.
    match = find_stop_string("xxabcd", 0, ["abcd", "bc"], False)
    assert (match.stop_string, match.truncate_to) == ("bc", 3)
    match = find_stop_string("xxabc", 0, ["bc", "abc"], True)
    assert (match.stop_string, match.truncate_to) == ("abc", 5)
    assert num_stop_prefix_chars("hello wor", ["world", "or"]) == 3
    assert num_stop_prefix_chars("hello", ["world"]) == 0
    assert num_stop_prefix_chars("ab", ["ab"]) == 0  # A whole stop string is a match, not a prefix.


def test_stop_string_single_token(tokenizer) -> None:
    ids = encode(tokenizer, "Hello world and more")
    detokenizer = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["Hello"]))
    deltas, stop = stream(detokenizer, ids)
    assert stop == "Hello" and detokenizer.output_text == "" and "".join(deltas) == ""


def test_stop_string_spanning_tokens(tokenizer) -> None:
    ids = encode(tokenizer, "Hello world STOP here")
    assert tokenizer.decode(ids[4:6]) == " ST"  # " S" + "T": the stop string spans several tokens.
    detokenizer = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["STOP"]))
    deltas, stop = stream(detokenizer, ids)
    assert stop == "STOP"
    assert detokenizer.output_text == "".join(deltas) == "Hello world "
    detokenizer = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["STOP"], include_stop_str_in_output=True))
    deltas, stop = stream(detokenizer, ids)
    assert detokenizer.output_text == "".join(deltas) == "Hello world STOP"


def test_stop_string_cut_inside_token_and_earliest_wins(tokenizer) -> None:
    ids = encode(tokenizer, "The capital of France is Paris.")
    detokenizer = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["Paris", "apit", "France"]))
    deltas, stop = stream(detokenizer, ids, [len(ids)])  # All in one step: "apit" completes first.
    assert stop == "apit" and detokenizer.output_text == "".join(deltas) == "The c"
    detokenizer = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["is", "France"],
                                                                       include_stop_str_in_output=True))
    deltas, stop = stream(detokenizer, ids)
    assert stop == "France" and detokenizer.output_text == "".join(deltas) == "The capital of France"


def test_min_tokens_defers_stop_strings(tokenizer) -> None:
    ids = encode(tokenizer, "Hello world Hello")
    assert len(ids) >= 3
    detokenizer = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["Hello"], min_tokens=2))
    _, stop = stream(detokenizer, ids)
    assert stop == "Hello" and detokenizer.output_text == "Hello world "


def test_streaming_holds_back_possible_stop_prefix(tokenizer) -> None:
    params = SamplingParams(stop=["STOP"])
    detokenizer = IncrementalDetokenizer(tokenizer, [1], params)
    shown = []
    for piece in ["Hello", " S", "T", "O", "ck"]:
        detokenizer.update(encode(tokenizer, piece))
        shown.append(detokenizer.get_next_output_text(finished=False, delta=True))
    # " S", "T", "O" could start "STOP": held back until "ck" breaks the match.
    assert shown == ["Hello", " ", "", "", "STOck"]
    detokenizer.update(encode(tokenizer, " STOP"))
    assert detokenizer.stop_string == "STOP"
    assert detokenizer.get_next_output_text(finished=True, delta=True) == " "
    assert detokenizer.output_text == "Hello STOck "


def test_streaming_never_retracts_text(tokenizer) -> None:
    rng = random.Random(2)
    words = ["ab", "abc", "b", "cab", "x", " ", "你", "好", "😀", "c"]
    for _ in range(40):
        text = "".join(rng.choice(words) for _ in range(15))
        stops = rng.sample(["abca", "bcab", "好😀", "cc", "x a"], 2)
        ids = encode(tokenizer, text)
        for delta in (True, False):
            params = SamplingParams(stop=stops)
            detokenizer = IncrementalDetokenizer(tokenizer, [1], params)
            shown: list[str] = []
            for position, token_id in enumerate(ids):
                is_last = position == len(ids) - 1
                stop = detokenizer.update([token_id], finished=is_last)
                shown.append(detokenizer.get_next_output_text(is_last or stop is not None, delta))
                if stop is not None:
                    break
            final = detokenizer.output_text
            if delta:
                assert "".join(shown) == final
            else:
                assert all(final.startswith(text_so_far) for text_so_far in shown) and shown[-1] == final
            assert not any(stop in final for stop in stops)


def test_no_text_without_detokenize(tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [1], SamplingParams(detokenize=False))
    assert detokenizer.update(encode(tokenizer, "Hello"), finished=True) is None
    assert detokenizer.output_text == "" and detokenizer.num_output_tokens == len(encode(tokenizer, "Hello"))
