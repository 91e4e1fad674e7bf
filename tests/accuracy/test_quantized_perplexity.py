"""Perplexity of the embedded SmolLM2-135M-Instruct on a fixed public-domain passage (tests/data), quantized against
unquantized: the GGUF file's Q4_1 blocks kept quantized score the passage as the same file dequantized at load
(within 0.1%)."""
from __future__ import annotations

import pytest

from pagedserve import LLM
from pagedserve.layers.gguf_linear import gguf_kernels_available
from pagedserve.model_loader.default_model import resolve_model_path
from perplexity import passage_text, perplexity


@pytest.fixture(scope="module")
def default_model_path() -> str:
    try:
        return resolve_model_path(None)
    except ValueError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def dequantized_perplexity(default_model_path: str) -> float:
    llm = LLM(default_model_path, dtype="float32", max_model_len=4096, num_kv_blocks=260, gguf_dequantize=True)
    return perplexity(llm, passage_text())


@pytest.mark.skipif(not gguf_kernels_available(), reason="the native CPU kernels are not built here")
def test_gguf_kept_quantized_scores_the_passage_as_dequantized(default_model_path: str,
                                                               dequantized_perplexity: float) -> None:
    llm = LLM(default_model_path, dtype="float32", max_model_len=4096, num_kv_blocks=260)
    kept = perplexity(llm, passage_text())
    assert 1.5 < dequantized_perplexity < 40  # a real model on real English
    assert abs(kept / dequantized_perplexity - 1) < 1e-3, (kept, dequantized_perplexity)
