"""Shared helpers for the on/off equivalence tests: seeded random token-id prompts, and the token ids an
LLM generates for them."""
from __future__ import annotations

import random

import pytest
import torch

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


def model_runner_forward(llm: LLM):
    """The forward the model runner calls (the native decode stack's wrapper when it took the model)."""
    return llm.llm_engine.engine_core.executor.worker.model_runner.forward


def greedy_outputs_with_logprobs(llm: LLM, prompts: list[list[int]], num_steps: int,
                                 **params) -> list[tuple[list[int], list]]:
    """Greedy `num_steps` tokens (EOS ignored) of each prompt, with each step's (token, logprob) pairs sorted when
    `params` asks for logprobs: what the decode-stack tests compare bit for bit."""
    sampling = SamplingParams(temperature=0.0, max_tokens=num_steps, ignore_eos=True, **params)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    return [(o.outputs[0].token_ids, [sorted((token, entry.logprob) for token, entry in step.items())
                                      for step in (o.outputs[0].logprobs or [])]) for o in outputs]


def count_stack_verifications(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by each step the decode stack verifies (greedy_targets returned ids): its number of rows."""
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    original = runner.greedy_targets
    assert original is not None, "the runner does not verify on the native decode stack"
    taken: list[int] = []

    def counted(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        token_ids = original(input_ids, positions)
        if token_ids is not None:
            taken.append(int(token_ids.numel()))
        return token_ids

    monkeypatch.setattr(runner, "greedy_targets", counted)
    return taken
