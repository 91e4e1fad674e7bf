"""StructuredOutputManager: grammars and matchers of the constrained requests, on the engine-core side.

Lifecycle of a constrained request: `add_request` starts its grammar's compilation on a compile thread (a
grammar compiled before is taken from the cache at once); the scheduler admits it only once `is_ready`
(the others keep stepping meanwhile); each step `grammar_bitmask` fills one bitmask row per position the
step samples for it (with speculative drafts: the drafts' positions too, the matcher advanced over them and
rolled back); `accept_tokens` advances its matcher with every token the scheduler appends; `free` drops it.
Matchers live here, beside the scheduler, because the scheduler sees every accepted token in order.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedserve.core.scheduler_output import GrammarBitmask
from pagedserve.reasoning.reasoning_parser import ReasoningParser, get_reasoning_parser
from pagedserve.structured_output.grammar_compiler import GrammarCompiler
from pagedserve.structured_output.structured_outputs_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

    from pagedserve.config.engine import EngineConfig

logger = logging.getLogger(__name__)


@dataclass
class _RequestGrammar:
    """One constrained request: its compilation (until done), then its matcher; or the compile error."""

    future: Future | None = None
    matcher: xgrammar.GrammarMatcher | None = None
    error: str | None = None
    # Reasoning models: the grammar applies once the output closed its reasoning (reasoning_parser).
    prompt_token_ids: list[int] | None = None  # held until the grammar is ready, to see whether the prompt closed it
    is_reasoning: bool = False
    reasoning_tail: str = ""  # the output's last characters while reasoning, to spot the end tag


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler, num_compile_threads: int = 1,
                 reasoning_parser: ReasoningParser | None = None) -> None:
        """`reasoning_parser`: the grammar of a request applies only after its reasoning ends (None: from the
        first output token)."""
        self.compiler = compiler
        self.reasoning_parser = reasoning_parser
        self._executor = ThreadPoolExecutor(max_workers=num_compile_threads, thread_name_prefix="grammar-compile")
        self._requests: dict[str, _RequestGrammar] = {}
        self.num_words = (compiler.vocab_size + 31) // 32

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> "StructuredOutputManager":
        model_config = config.model_config
        structured = config.structured_outputs_config

        def load_tokenizer() -> tuple[Any, list[int]]:
            from pagedserve.model_loader.model_source import open_model_source

            source = open_model_source(model_config.model)
            tokenizer = source.load_tokenizer(model_config.tokenizer)
            return tokenizer, sorted(source.eos_token_ids(tokenizer))

        compiler = GrammarCompiler(load_tokenizer, model_config.vocab_size, structured.grammar_cache_size)
        reasoning_parser = None
        if structured.reasoning_parser is not None:
            reasoning_parser = get_reasoning_parser(structured.reasoning_parser)
        return cls(compiler, structured.num_compile_threads, reasoning_parser)

    # ---- requests in and out -------------------------------------------------------------------------
    def add_request(self, request_id: str, params: StructuredOutputsParams,
                    prompt_token_ids: list[int] | None = None) -> None:
        """Start compiling the request's grammar (a cached one is ready at once)."""
        key = params.cache_key
        state = _RequestGrammar(prompt_token_ids=prompt_token_ids)
        if self.compiler.is_cached(key):
            self._start_matcher(state, self.compiler.compile(key))
        else:
            state.future = self._executor.submit(self.compiler.compile, key)
        self._requests[request_id] = state

    def is_ready(self, request_id: str) -> bool:
        """True once the request's grammar compiled (or failed: then `error` says why)."""
        state = self._requests[request_id]
        if state.future is None:
            return True
        if not state.future.done():
            return False
        future, state.future = state.future, None
        try:
            self._start_matcher(state, future.result())
        except Exception as error:  # the front end validated it; a failure here is the backend's
            logger.exception("compiling the grammar of request %s failed", request_id)
            state.error = f"the structured output constraint could not be compiled: {error}"
        return True

    def error(self, request_id: str) -> str | None:
        return self._requests[request_id].error

    def _start_matcher(self, state: _RequestGrammar, compiled: xgrammar.CompiledGrammar) -> None:
        import xgrammar  # imported on first use: an engine without it runs, refusing structured outputs

        state.matcher = xgrammar.GrammarMatcher(compiled)  # rollback is unlimited in xgrammar 0.2
        parser = self.reasoning_parser
        if parser is not None:
            prompt_text = self.compiler.tokenizer.decode(state.prompt_token_ids or [])
            state.is_reasoning = not parser.is_reasoning_ended_in_prompt(prompt_text)
        state.prompt_token_ids = None

    def free(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        if state is not None and state.future is not None:
            state.future.cancel()

    # ---- per step ------------------------------------------------------------------------------------
    def grammar_bitmask(self, sampled_positions: list[tuple[str, list[int]]]) -> GrammarBitmask | None:
        """Rows for the constrained requests a step samples: (request id, drafts scored after it).

        A request gets 1 + len(drafts) rows: the next token's, then each draft position's, filled with the matcher
        advanced over the drafts before it and rolled back after. The scheduler keeps only drafts the grammar
        accepts (valid_draft_prefix); should one still be refused, the rows after it stay all-allowed: verification
        never emits a token past a rejected draft. Requests still reasoning or past the end of their grammar get no
        rows. None when no row is constrained.
        """
        rows: list[tuple[str, xgrammar.GrammarMatcher, list[int]]] = []
        for request_id, draft_token_ids in sampled_positions:
            state = self._requests.get(request_id)
            if state is None or state.matcher is None or state.is_reasoning or state.matcher.is_terminated():
                continue
            rows.append((request_id, state.matcher, draft_token_ids))
        if not rows:
            return None
        num_rows = sum(1 + len(drafts) for _, _, drafts in rows)
        bitmask = np.full((num_rows, self.num_words), -1, dtype=np.int32)
        first_row: dict[str, int] = {}
        row = 0
        for request_id, matcher, draft_token_ids in rows:
            first_row[request_id] = row
            matcher.fill_next_token_bitmask(bitmask, row)
            num_advanced = 0
            for draft_token_id in draft_token_ids:
                if matcher.is_terminated() or not matcher.accept_token(draft_token_id):
                    break
                num_advanced += 1
                matcher.fill_next_token_bitmask(bitmask, row + num_advanced)
            if num_advanced:
                matcher.rollback(num_advanced)
            row += 1 + len(draft_token_ids)
        return GrammarBitmask(first_row=first_row, num_rows=num_rows, num_words=self.num_words,
                              bitmask=bitmask.tobytes())

    def valid_draft_prefix(self, request_id: str, draft_token_ids: list[int]) -> list[int]:
        """The longest prefix of `draft_token_ids` the request's grammar accepts (the matcher is left unchanged)."""
        state = self._requests.get(request_id)
        if state is None or state.matcher is None or state.is_reasoning:
            return draft_token_ids
        matcher = state.matcher
        num_valid = 0
        for token_id in draft_token_ids:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            num_valid += 1
        if num_valid:
            matcher.rollback(num_valid)
        return draft_token_ids[:num_valid]

    def accept_token(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher over a generated token; False when the grammar rejects it."""
        state = self._requests.get(request_id)
        if state is None or state.matcher is None:
            return True
        if state.is_reasoning:
            self._observe_reasoning_token(state, token_id)
            return True
        if state.matcher.is_terminated():
            # Past the end of the grammar (its stop token did not end the request, e.g. ignore_eos): unconstrained.
            return True
        return bool(state.matcher.accept_token(token_id))

    def _observe_reasoning_token(self, state: _RequestGrammar, token_id: int) -> None:
        """Track a token generated while reasoning; the end tag ends the reasoning (the grammar applies next)."""
        parser = self.reasoning_parser
        assert parser is not None
        # Tags are ASCII: token-by-token decoding spells them whole, whatever the tokens around them.
        state.reasoning_tail = (state.reasoning_tail + self.compiler.tokenizer.decode([token_id]))[-64:]
        if parser.ends_reasoning(state.reasoning_tail):
            state.is_reasoning = False

    def is_reasoning(self, request_id: str) -> bool:
        state = self._requests.get(request_id)
        return state is not None and state.is_reasoning

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
