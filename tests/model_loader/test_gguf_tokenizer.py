"""The tokenizer built from GGUF metadata matches transformers' own GGUF tokenizer, id for id."""
from __future__ import annotations

import os

import pytest
from test_gguf_tiny_files import CONTROL_TOKENS, write_tiny_gguf

from pagedserve.model_loader.default_model import resolve_model_path
from pagedserve.model_loader.gguf_loader import load_gguf
from pagedserve.model_loader.gguf_tokenizer import build_tokenizer

TEXTS = [
    "Hello, world! This is a plain English sentence with punctuation; doesn't it?",
    "The quick brown fox jumps over the lazy dog. I'm sure we'll see, they've said.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i] * 3.14159; }  // C++ loop\r\n\tindented",
    "Numbers: 0 7 42 1234567890 3.14 -12e5 2024-11-29 $1,000,000",
    "中文文本测试：你好，世界！日本語のテキスト。한국어 텍스트.",
    "Emoji 😀🎉👍🏽 and flags 🇫🇷 plus ZWJ 👨‍👩‍👧 sequences",
    "   leading spaces, trailing spaces   \n\n\n  multiple\t\ttabs \u00a0nbsp    runs      ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>pagedserve<file_sep>main.py<|endoftext|>",
    "Ünïcödé àccents: naïve café résumé façade Ωμέγα Привет мир",
    "",
    " ",
    "a",
]


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    return resolve_model_path(None)


@pytest.fixture(scope="module")
def our_tokenizer(smollm2_path: str):
    return load_gguf(smollm2_path, use_cache=False).tokenizer


@pytest.fixture(scope="module")
def transformers_tokenizer(smollm2_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_transformers_gguf_tokenizer(text: str, our_tokenizer, transformers_tokenizer) -> None:
    ours = our_tokenizer(text).input_ids
    assert ours == transformers_tokenizer(text).input_ids
    assert our_tokenizer.decode(ours) == text  # byte-level BPE round-trips exactly
    assert our_tokenizer.decode(ours, skip_special_tokens=True) == transformers_tokenizer.decode(
        ours, skip_special_tokens=True
    )


def test_special_tokens_and_template(our_tokenizer, transformers_tokenizer) -> None:
    assert len(our_tokenizer) == len(transformers_tokenizer) == 49152
    for attribute in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id"):
        assert getattr(our_tokenizer, attribute) == getattr(transformers_tokenizer, attribute), attribute
    assert our_tokenizer.chat_template == transformers_tokenizer.chat_template
    assert our_tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ours = our_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours == transformers_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("add_bos", [False, True])
def test_tiny_vocabulary_merges_control_tokens_and_bos_flag(tmp_path, add_bos: bool) -> None:
    path = os.path.join(tmp_path, "tiny.gguf")
    write_tiny_gguf(path, "qwen2", add_bos=add_bos)
    tokenizer = load_gguf(path, use_cache=False).tokenizer
    hello, world = tokenizer.convert_tokens_to_ids(["hello", "Ġworld"])
    ids = tokenizer("<|im_start|>hello world").input_ids
    assert ids == ([1] if add_bos else []) + [1, hello, world]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello world"
    assert tokenizer.bos_token == CONTROL_TOKENS[1] and tokenizer.pad_token == CONTROL_TOKENS[0]


def test_missing_or_unsupported_tokenizer_metadata_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="tokenizer.ggml.model='llama' is not supported"):
        build_tokenizer({"tokenizer.ggml.model": "llama"}, source="x.gguf")
    with pytest.raises(ValueError, match="x.gguf.*no tokenizer.ggml.model"):
        build_tokenizer({}, source="x.gguf")
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
                "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.bos_token_id": 5}
    with pytest.raises(ValueError, match="bos_token_id=5 is out of range"):
        build_tokenizer(metadata, source="x.gguf")
    with pytest.raises(ValueError, match=r"merges\[0\]='a c' uses or makes a token"):
        build_tokenizer(dict(metadata, **{"tokenizer.ggml.merges": ["a c"]}), source="x.gguf")
    with pytest.raises(ValueError, match="merges\\[0\\]='abc' is not two tokens"):
        build_tokenizer(dict(metadata, **{"tokenizer.ggml.merges": ["abc"]}), source="x.gguf")


@pytest.fixture(scope="module")
def cached_tokenizers(smollm2_path: str, tmp_path_factory):
    """The default model's tokenizer built with the cache (cold: it writes the pipeline) and read back (warm)."""
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("tokenizer-cache")))
    try:
        cold = load_gguf(smollm2_path).tokenizer
        warm = load_gguf(smollm2_path).tokenizer
    finally:
        monkeypatch.undo()
    return cold, warm


def test_cached_pipeline_gives_the_same_tokenizer(cached_tokenizers, our_tokenizer) -> None:
    cold, warm = cached_tokenizers
    assert warm.backend_tokenizer.to_str() == cold.backend_tokenizer.to_str() == \
        our_tokenizer.backend_tokenizer.to_str()
    for attribute in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id",
                      "all_special_ids", "chat_template", "clean_up_tokenization_spaces"):
        assert getattr(warm, attribute) == getattr(our_tokenizer, attribute), attribute
    assert len(warm) == len(our_tokenizer)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert warm.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        our_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for text in TEXTS:
        ids = our_tokenizer(text).input_ids
        assert warm(text).input_ids == ids and warm.encode(text, add_special_tokens=False) == \
            our_tokenizer.encode(text, add_special_tokens=False)
        assert warm.decode(ids) == our_tokenizer.decode(ids)
        assert warm.decode(ids, skip_special_tokens=True) == our_tokenizer.decode(ids, skip_special_tokens=True)
        assert warm.convert_ids_to_tokens(ids) == our_tokenizer.convert_ids_to_tokens(ids)


def test_bad_cached_pipeline_is_rebuilt(tmp_path, monkeypatch) -> None:
    import glob

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = os.path.join(tmp_path, "tiny.gguf")
    write_tiny_gguf(path, "llama")
    expected = load_gguf(path).tokenizer.backend_tokenizer.to_str()
    [entry] = glob.glob(str(tmp_path / "cache" / "tokenizers" / "*.json"))
    with open(entry, "w") as f:
        f.write("{not json")
    assert load_gguf(path).tokenizer.backend_tokenizer.to_str() == expected
    from tokenizers import Tokenizer

    Tokenizer.from_file(entry)  # written again, whole
