"""Perplexity of a model on a fixed text through the engine (prompt logprobs): the accuracy check of quantized
weights and caches against the unquantized model on real text (tests/data/public_domain_passage.txt)."""
from __future__ import annotations

import math
import os

from pagedserve import LLM, SamplingParams

PASSAGE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "public_domain_passage.txt")


def passage_text() -> str:
    """About 2,900 SmolLM2 tokens of public-domain English (the Declaration of Independence, the Gettysburg Address
    and Lincoln's second inaugural address)."""
    with open(PASSAGE_PATH, encoding="utf-8") as passage:
        return passage.read()


def perplexity(llm: LLM, text: str, max_tokens: int | None = None) -> float:
    """exp of the mean negative log-likelihood of every token of `text` (its first `max_tokens` tokens when given)
    after the first, as the engine scores the prompt (prompt_logprobs=0: each position's own token)."""
    token_ids = llm.get_tokenizer()(text, add_special_tokens=False)["input_ids"][:max_tokens]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    output = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
    scores = output.prompt_logprobs
    assert scores is not None and len(scores) == len(token_ids)
    log_likelihood = sum(scores[position][token].logprob for position, token in enumerate(token_ids) if position > 0)
    return math.exp(-log_likelihood / (len(token_ids) - 1))
