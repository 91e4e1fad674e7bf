"""GrammarCompiler: constraints -> xgrammar CompiledGrammar for one tokenizer, each distinct one compiled once.

The tokenizer is loaded on first use (on the compile thread, so the engine loop never waits for it). The
cache is keyed by StructuredOutputsParams.cache_key and keeps the `cache_size` most recently used grammars.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import xgrammar


class GrammarCompiler:
    """Thread-safe: the manager's compile threads share it."""

    def __init__(self, load_tokenizer: Callable[[], tuple[Any, list[int]]], vocab_size: int,
                 cache_size: int, num_threads: int = 1) -> None:
        """`load_tokenizer` returns (HF tokenizer, stop token ids); `vocab_size` is the model's logits width."""
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.num_threads = num_threads
        self._compiler: xgrammar.GrammarCompiler | None = None
        self.tokenizer: Any | None = None  # set with the backend, on first use
        self._cache: OrderedDict[tuple[str, str], xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0
        self.num_cache_hits = 0

    def _backend(self) -> xgrammar.GrammarCompiler:
        import xgrammar  # imported on first use: an engine without it runs, refusing structured outputs

        with self._lock:
            if self._compiler is None:
                tokenizer, stop_token_ids = self._load_tokenizer()
                self.tokenizer = tokenizer
                tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=sorted(stop_token_ids))
                # Our own cache below is the one that counts; xgrammar's would hold a second copy.
                self._compiler = xgrammar.GrammarCompiler(tokenizer_info, max_threads=self.num_threads,
                                                          cache_enabled=False)
            return self._compiler

    def compile(self, key: tuple[str, str]) -> xgrammar.CompiledGrammar:
        """The compiled grammar of (kind, spec) (StructuredOutputsParams.cache_key); raises on a bad spec."""
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return compiled
        compiled = compile_with(self._backend(), *key)
        with self._lock:
            self.num_compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def is_cached(self, key: tuple[str, str]) -> bool:
        with self._lock:
            return key in self._cache


def compile_with(compiler: xgrammar.GrammarCompiler, kind: str, spec: str) -> xgrammar.CompiledGrammar:
    """One constraint compiled by `compiler`. JSON is generated compact (no free whitespace): a model cannot
    then pad its output with endless blanks."""
    if kind == "json":
        return compiler.compile_json_schema(spec, any_whitespace=False)
    if kind == "json_object":
        # OpenAI's json_object: any JSON object (xgrammar's builtin JSON grammar would allow any JSON value).
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "grammar":
        return compiler.compile_grammar(spec)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(json.loads(spec)))
    raise ValueError(f"structured output kind={kind!r} is not one of json, json_object, regex, grammar, choice")


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (each a JSON-escaped string literal)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)
