"""Fixtures for the structured-output tests: the default model (SmolLM2-135M-Instruct, embedded GGUF)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from default_model_prompts import DEFAULT_MODEL_KWARGS  # noqa: E402


@pytest.fixture(scope="module")
def default_llm():
    from pagedserve import LLM

    llm = LLM(**DEFAULT_MODEL_KWARGS)
    yield llm
    llm.llm_engine.shutdown()
