"""Build a transformers fast tokenizer from the `tokenizer.ggml.*` metadata of a GGUF file.

A GGUF file carries no tokenizer.json: llama.cpp stores the vocabulary, the BPE merges, per-token
types and the special-token ids as metadata. For byte-level BPE vocabularies
(`tokenizer.ggml.model == 'gpt2'`, used by Llama-3, Qwen2/3, SmolLM, StarCoder, ...) this module
rebuilds the equivalent `tokenizers` pipeline: the pre-tokenizer split named by
`tokenizer.ggml.pre`, byte-level BPE, byte-level decoding, control tokens as special added tokens
and the BOS/EOS template from `tokenizer.ggml.add_bos_token` / `add_eos_token`.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

logger = logging.getLogger(__name__)

# llama.cpp token types (enum llama_token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

SUPPORTED_TOKENIZER_MODELS = ("gpt2",)

# Pre-tokenizer split patterns, by the `tokenizer.ggml.pre` names llama.cpp writes. These are the
# patterns the vocabularies were trained with (tiktoken cl100k style for Llama-3, with single
# digits for Qwen2).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PATTERNS: dict[str, str] = {
    **{name: _LLAMA3_PATTERN for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx")},
    **{name: _QWEN2_PATTERN for name in ("qwen2", "deepseek-r1-qwen", "megrez")},
}
# These vocabularies isolate every digit before the GPT-2 split (llama.cpp's STARCODER/SMOLLM
# pre-tokenizer group; the original tokenizer.json files use a `Digits` pre-tokenizer).
_INDIVIDUAL_DIGIT_PRE_TYPES = frozenset({"starcoder", "smollm", "refact", "codeshell", "command-r", "exaone", "minerva"})
# Plain GPT-2 split (ByteLevel's built-in regex).
_GPT2_PRE_TYPES = frozenset({"default", "gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion"})


def _gpt2_byte_map() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level BPE vocabularies use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    mapping = {byte: chr(byte) for byte in printable}
    next_code = 256
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(next_code)
            next_code += 1
    return mapping


def _byte_level_spelling(token: str, byte_map: dict[int, str], alphabet: frozenset[str]) -> str:
    """The token as the byte-level vocabulary spells it: already spelled tokens stay as they are,
    a token written in plain text (some converters do that for added tokens) is re-spelled."""
    if set(token) <= alphabet:
        return token
    return "".join(byte_map[byte] for byte in token.encode("utf-8"))


def _pre_tokenizer(pre_type: str | None) -> pre_tokenizers.PreTokenizer:
    if pre_type in _SPLIT_PATTERNS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PATTERNS[pre_type]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_type in _INDIVIDUAL_DIGIT_PRE_TYPES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre_type is not None and pre_type not in _GPT2_PRE_TYPES:
        logger.warning("GGUF tokenizer.ggml.pre=%r is not known to pagedserve; using the GPT-2 split", pre_type)
    return byte_level


def _special_token(metadata: Mapping[str, Any], key: str, tokens: list[str], source: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    if token_id is None:
        return None
    token_id = int(token_id)
    if not 0 <= token_id < len(tokens):
        raise ValueError(
            f"{source}: tokenizer.ggml.{key}={token_id} is out of range; expected 0..{len(tokens) - 1}"
        )
    return tokens[token_id]


def build_tokenizer(metadata: Mapping[str, Any], source: str = "<gguf>", cache_path: str | None = None) -> Any:
    """A `transformers.PreTrainedTokenizerFast` equivalent to the tokenizer the metadata describes.

    `metadata` maps GGUF keys to their decoded values (strings, ints, lists). `source` names the
    file in error messages. Raises ValueError for missing keys or an unsupported tokenizer model.

    With `cache_path` (a file named after everything the pipeline depends on: see
    gguf_loader.GGUFModel.tokenizer), the `tokenizers` pipeline is read from that file when an earlier
    build wrote it there, skipping the vocabulary and merge checks in Python (~0.5 s for a 49k-token
    vocabulary on a 2-core machine). It is the pipeline's own JSON serialization, the same round trip
    transformers makes when it copies the pipeline it is given, so both ways give the same tokenizer.
    """
    from transformers import PreTrainedTokenizerFast

    if cache_path is not None and os.path.isfile(cache_path):
        try:
            return PreTrainedTokenizerFast(tokenizer_file=cache_path, **_wrapper_options(metadata, source))
        except Exception as error:  # an unreadable entry: built again and rewritten below
            logger.warning("GGUF tokenizer cache: cannot read %s (%s); building the tokenizer again", cache_path,
                           error)
    backend = _build_pipeline(metadata, source)
    if cache_path is not None:
        from pagedserve.model_loader.gguf_cache import _write_atomically

        try:
            _write_atomically(cache_path, backend.to_str().encode())
        except OSError as error:
            logger.warning("GGUF tokenizer cache: cannot write %s (%s)", cache_path, error)
    # transformers builds the BOS/EOS TemplateProcessing from the add_bos_token / add_eos_token flags.
    return PreTrainedTokenizerFast(tokenizer_object=backend, **_wrapper_options(metadata, source))


def _tokens(metadata: Mapping[str, Any], source: str) -> list[str]:
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{source}: the GGUF metadata has no tokenizer.ggml.tokens")
    return [str(token) for token in tokens]


def _wrapper_options(metadata: Mapping[str, Any], source: str) -> dict[str, Any]:
    """PreTrainedTokenizerFast's arguments besides the pipeline: special tokens, BOS/EOS flags, chat template."""
    tokens = _tokens(metadata, source)
    bos_token = _special_token(metadata, "bos_token_id", tokens, source)
    eos_token = _special_token(metadata, "eos_token_id", tokens, source)
    unk_token = _special_token(metadata, "unknown_token_id", tokens, source)
    pad_token = _special_token(metadata, "padding_token_id", tokens, source)
    add_bos_token = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos_token is not None
    add_eos_token = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos_token is not None
    return dict(
        bos_token=bos_token,
        eos_token=eos_token,
        unk_token=unk_token,
        pad_token=pad_token,
        add_bos_token=add_bos_token,
        add_eos_token=add_eos_token,
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def _build_pipeline(metadata: Mapping[str, Any], source: str) -> Tokenizer:
    """The `tokenizers` pipeline (byte-level BPE, pre-tokenizer, decoder, added tokens) the metadata describes."""
    tokenizer_model = metadata.get("tokenizer.ggml.model")
    if tokenizer_model is None:
        raise ValueError(f"{source}: the GGUF metadata has no tokenizer.ggml.model; cannot build a tokenizer")
    if tokenizer_model not in SUPPORTED_TOKENIZER_MODELS:
        raise ValueError(
            f"{source}: tokenizer.ggml.model={tokenizer_model!r} is not supported; "
            f"supported: {list(SUPPORTED_TOKENIZER_MODELS)}"
        )
    tokens = _tokens(metadata, source)
    merge_lines = metadata.get("tokenizer.ggml.merges")
    if merge_lines is None:
        raise ValueError(f"{source}: tokenizer.ggml.model='gpt2' needs tokenizer.ggml.merges, which is missing")
    token_types = list(metadata.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens))
    if len(token_types) != len(tokens):
        raise ValueError(
            f"{source}: tokenizer.ggml.token_type has {len(token_types)} entries but "
            f"tokenizer.ggml.tokens has {len(tokens)}"
        )

    byte_map = _gpt2_byte_map()
    alphabet = frozenset(byte_map.values())
    vocab = {_byte_level_spelling(token, byte_map, alphabet): index for index, token in enumerate(tokens)}
    merges: list[tuple[str, str]] = []
    for line_number, line in enumerate(merge_lines):
        parts = str(line).split(" ")
        if len(parts) != 2:
            raise ValueError(
                f"{source}: tokenizer.ggml.merges[{line_number}]={line!r} is not two tokens separated by one space"
            )
        # tokenizers aborts the process (a Rust panic) on a merge outside the vocabulary.
        if parts[0] not in vocab or parts[1] not in vocab or parts[0] + parts[1] not in vocab:
            raise ValueError(
                f"{source}: tokenizer.ggml.merges[{line_number}]={line!r} uses or makes a token "
                f"that is not in tokenizer.ggml.tokens"
            )
        merges.append((parts[0], parts[1]))

    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>, <|endoftext|>, ...) must match whole and be special; a control
    # token spelled outside the byte alphabet is a mislabel in the file (not a real vocabulary
    # entry), so it is left alone. User-defined tokens (<think>, ...) also match whole, unspecial.
    special_tokens = [
        AddedToken(token, normalized=False, special=True)
        for token, token_type in zip(tokens, token_types)
        if int(token_type) == TOKEN_TYPE_CONTROL and set(token) <= alphabet
    ]
    user_tokens = [
        AddedToken(token, normalized=False, special=False)
        for token, token_type in zip(tokens, token_types)
        if int(token_type) == TOKEN_TYPE_USER_DEFINED and token in vocab
    ]
    if special_tokens:
        backend.add_special_tokens(special_tokens)
    if user_tokens:
        backend.add_tokens(user_tokens)
    return backend
