"""Shared helpers for the on/off equivalence tests: seeded random token-id prompts, and the token ids an
LLM generates for them."""
from __future__ import annotations

import random

from pagedserve import LLM, SamplingParams


# Greedy, 36 tokens, EOS ignored: the drafter tests' reference and comparisons (tests/spec_decode/conftest.py).
GREEDY_36 = SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True)


# The default model's chat prompts (its answers are checked against transformers and across cache dtypes).
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Explain photosynthesis in one sentence.",
]


def random_prompts(num: int, low: int, high: int, seed: int) -> list[list[int]]:
    """`num` prompts of random token ids in [8, 400), lengths uniform in [low, high]."""
    rng = random.Random(seed)
    return [[rng.randrange(8, 400) for _ in range(rng.randint(low, high))] for _ in range(num)]


def generated_token_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """The first completion's token ids for each prompt, in prompt order."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def seeded_tokens_alone_and_in_batch(llm: LLM, prompts: list[list[int]]) -> tuple[list[int], list[int]]:
    """The first prompt's tokens under a seeded sampled request run alone, then beside the others (unseeded)."""
    seeded = SamplingParams(temperature=0.9, top_k=30, seed=13, max_tokens=20, ignore_eos=True)
    alone = generated_token_ids(llm, prompts[:1], seeded)[0]
    others = SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True)
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], [seeded] + [others] * (len(prompts) - 1),
                            use_tqdm=False)
    return alone, together[0].outputs[0].token_ids
