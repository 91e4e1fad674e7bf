"""InputProcessor: turn a user prompt and SamplingParams into validated engine Requests.

It tokenizes text prompts (adding special tokens as the tokenizer does by default, like vLLM), checks
the prompt against the model (vocabulary, context length), resolves max_tokens, fills the EOS ids the
scheduler stops on, and fans n > 1 out into n child requests (see parallel_sampling.py).
"""
from __future__ import annotations

import json
import numbers
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union

from pagedserve.core.request import Request
from pagedserve.engine.parallel_sampling import ParentRequest
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output.grammar_validation import validate_structured_outputs

# A prompt is text, or a dict with 'prompt_token_ids' (optionally with the 'prompt' text they came
# from) or with 'prompt' alone; 'cache_salt' may be added to keep this request's KV cache private.
PromptType = Union[str, Mapping[str, Any]]
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


def prompt_text_of(prompt: PromptType) -> str | None:
    """The prompt's text, when the user gave one (for RequestOutput.prompt)."""
    if isinstance(prompt, str):
        return prompt
    text = prompt.get("prompt") if isinstance(prompt, Mapping) else None
    return text if isinstance(text, str) else None


def read_generation_config_eos_token_ids(model_folder: str) -> list[int]:
    """The eos_token_id(s) of a local HF folder's generation_config.json ([] when absent)."""
    path = os.path.join(model_folder, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(token) for token in eos]


class InputProcessor:
    """Tokenizes and validates requests before they reach the engine core.

    `tokenizer` may be None (skip tokenizer init): then prompts must be token ids and detokenization
    is off. `eos_token_ids` are extra stop ids (e.g. from generation_config.json) on top of the
    tokenizer's eos_token_id.
    """

    def __init__(self, tokenizer: Any | None, *, vocab_size: int, max_model_len: int,
                 eos_token_ids: Iterable[int] | None = None, structured_outputs_refusal: str | None = None) -> None:
        """`structured_outputs_refusal`: why this engine cannot constrain outputs (None: it can)."""
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size!r} must be an integer >= 1")
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len={max_model_len!r} must be an integer >= 2")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        tokenizer_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self.eos_token_id: int | None = int(tokenizer_eos) if tokenizer_eos is not None else None
        all_eos = [] if self.eos_token_id is None else [self.eos_token_id]
        all_eos += [int(token) for token in (eos_token_ids or [])]
        self.eos_token_ids: frozenset[int] = frozenset(all_eos)
        self.structured_outputs_refusal = structured_outputs_refusal

    @classmethod
    def from_model_config(cls, tokenizer: Any | None, model_config: Any) -> "InputProcessor":
        """Build from a ModelConfig: its vocab size, max_model_len and generation_config.json EOS ids."""
        extra_eos = read_generation_config_eos_token_ids(model_config.model) if os.path.isdir(
            model_config.model) else []
        return cls(tokenizer, vocab_size=model_config.vocab_size, max_model_len=model_config.max_model_len,
                   eos_token_ids=extra_eos)

    # ---------------------------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> list[int]:
        """Prompt token ids: given ones as they are, text tokenized with the tokenizer's special tokens."""
        if isinstance(prompt, str):
            return self._encode(prompt, field_name="prompt")
        if not isinstance(prompt, Mapping):
            raise ValueError(
                f"prompt={prompt!r} must be a str or a dict with 'prompt_token_ids' or 'prompt'")
        unknown = sorted(set(prompt) - _PROMPT_KEYS)
        if unknown:
            raise ValueError(f"prompt keys {unknown} are not supported; allowed keys: {sorted(_PROMPT_KEYS)}")
        if "prompt_token_ids" in prompt:
            token_ids = prompt["prompt_token_ids"]
            if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
                raise ValueError(f"prompt_token_ids={token_ids!r} must be a list of integers")
            bad = [t for t in token_ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
            if bad:
                raise ValueError(f"prompt_token_ids contains {bad[0]!r}, which is not an integer")
            return [int(t) for t in token_ids]
        if "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str):
                raise ValueError(f"prompt={text!r} must be a str")
            return self._encode(text, field_name="prompt")
        raise ValueError("prompt dict must have 'prompt_token_ids' or 'prompt'")

    def _encode(self, text: str, field_name: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{field_name} is text but no tokenizer is loaded; pass 'prompt_token_ids'")
        if not text:
            # A tokenizer may turn "" into [BOS] alone; nothing to complete is a client mistake.
            raise ValueError(f"{field_name} is empty: it has 0 characters; at least 1 is required")
        return list(self.tokenizer.encode(text))

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise ValueError when the prompt is empty, has out-of-vocabulary ids, or fills the context."""
        if not prompt_token_ids:
            raise ValueError("prompt is empty: it has 0 tokens; at least 1 is required")
        for token_id in prompt_token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"prompt token id {token_id} is out of vocabulary: ids must be in [0, {self.vocab_size}) "
                    f"(vocab_size={self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens, which must be < max_model_len={self.max_model_len} "
                "(at least one token is generated)")

    def resolve_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """A copy of `params` with max_tokens resolved and the EOS stop ids filled (the user's object
        is never changed)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params={params!r} must be a SamplingParams")
        room = self.max_model_len - num_prompt_tokens
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise ValueError(
                f"prompt has {num_prompt_tokens} tokens and max_tokens={max_tokens}: together "
                f"{num_prompt_tokens + max_tokens} > max_model_len={self.max_model_len}; "
                f"max_tokens must be <= {room}")
        if params.min_tokens > max_tokens:
            raise ValueError(f"min_tokens={params.min_tokens} must be <= max_tokens={max_tokens}")
        for token_id in params.stop_token_ids:
            if token_id >= self.vocab_size:
                raise ValueError(
                    f"stop_token_ids contains {token_id}, outside [0, {self.vocab_size}) (vocab_size={self.vocab_size})")
        if params.stop and (not params.detokenize or self.tokenizer is None):
            raise ValueError(
                f"stop={params.stop!r} needs detokenize=True and a tokenizer; stop strings are matched on text")
        if params.structured_outputs is not None:
            if self.structured_outputs_refusal is not None:
                raise ValueError(f"structured_outputs is not supported by this engine: {self.structured_outputs_refusal}")
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer (the grammar is matched on token texts)")
            validate_structured_outputs(params.structured_outputs)
        eos_ids = set() if params.ignore_eos else set(self.eos_token_ids)
        return params.clone(max_tokens=max_tokens, all_stop_token_ids=eos_ids)

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                priority: int = 0, arrival_time: float | None = None) -> list[Request]:
        """Validated engine Requests for one user request: one Request, or n children when n > 1.

        Children of an n > 1 request have ids f"{i}_{request_id}", n=1 and, when seeded, seed + i
        (see ParentRequest.child_sampling_params); hand them all to OutputProcessor.add_request, which
        fans their outputs back in under `request_id`.
        Raises ValueError naming the field, value and limit on bad input.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id={request_id!r} must be a non-empty str")
        if not isinstance(priority, int):
            raise ValueError(f"priority={priority!r} must be an integer")
        prompt_token_ids = self.tokenize(prompt)
        self.validate_prompt(prompt_token_ids)
        resolved = self.resolve_params(params, len(prompt_token_ids))
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt={cache_salt!r} must be a str")
        eos_token_id = None if resolved.ignore_eos else self.eos_token_id
        extra: dict[str, Any] = {} if arrival_time is None else {"arrival_time": arrival_time}

        if resolved.n == 1:
            return [Request(request_id=request_id, prompt_token_ids=prompt_token_ids, sampling_params=resolved,
                            eos_token_id=eos_token_id, priority=priority, cache_salt=cache_salt, **extra)]
        parent = ParentRequest(request_id, resolved)
        if arrival_time is None:
            # One arrival time for all children keeps them adjacent in the scheduler's queue.
            extra["arrival_time"] = time.monotonic()
        return [
            Request(request_id=parent.child_request_ids[index], prompt_token_ids=list(prompt_token_ids),
                    sampling_params=parent.child_sampling_params(index), eos_token_id=eos_token_id,
                    priority=priority, cache_salt=cache_salt, **extra)
            for index in range(parent.num_children)
        ]


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        chat_template: str | None = None, tokenize: bool = True,
                        **kwargs: Any) -> list[int] | str:
    """Render chat `messages` with the tokenizer's (or the given) chat template, for LLM.chat.

    Returns the prompt token ids (or the text with tokenize=False). The text is tokenized WITHOUT
    adding special tokens again: the template already writes them, and a second BOS would change the
    model's output. Extra keyword arguments reach the template (e.g. tools, enable_thinking).
    """
    if tokenizer is None:
        raise ValueError("apply_chat_template needs a tokenizer, but none is loaded")
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise ValueError(f"messages={messages!r} must be a list of dicts with 'role' and 'content'")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "chat_template=None and the tokenizer has no chat template; pass chat_template=<jinja template>")
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt,
        chat_template=chat_template, **kwargs)
    if not isinstance(text, str):
        raise ValueError(f"the chat template rendered {type(text).__name__}, expected str")
    if not tokenize:
        return text
    return list(tokenizer.encode(text, add_special_tokens=False))
