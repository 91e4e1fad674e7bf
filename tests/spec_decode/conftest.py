"""Shared fixtures of the drafter tests: the tiny float32 llama target, four random prompts and its greedy output
without speculation (36 tokens each), which every method's greedy output must equal."""
from __future__ import annotations

import pytest

from generation_helpers import GREEDY_36, generated_token_ids, random_prompts
from pagedserve import LLM


@pytest.fixture(scope="module")
def folder(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(4, 5, 40, seed=11)


@pytest.fixture(scope="module")
def reference(folder: str, prompts) -> list[list[int]]:
    return generated_token_ids(LLM(folder, max_model_len=256, num_kv_blocks=256), prompts, GREEDY_36)
