"""Fixtures for the structured-output tests: the default model (SmolLM2-135M-Instruct, embedded GGUF)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Small enough for 2 CPU cores; room for every request of the schema suite at once.
DEFAULT_MODEL_KWARGS = dict(max_model_len=1024, num_kv_blocks=512, block_size=16)


@pytest.fixture(scope="module")
def default_llm():
    from pagedserve import LLM

    llm = LLM(**DEFAULT_MODEL_KWARGS)
    yield llm
    llm.llm_engine.shutdown()


def chat_prompt(llm, question: str) -> dict:
    """The default model's chat-templated prompt for one user question."""
    from pagedserve.engine.input_processor import apply_chat_template

    return {"prompt_token_ids": apply_chat_template(llm.get_tokenizer(), [{"role": "user", "content": question}])}
