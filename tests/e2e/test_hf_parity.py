"""pagedserve vs HF transformers on tiny random models: greedy tokens and top-5 logprobs."""
from __future__ import annotations

import random

import pytest
import torch

from hf_reference import hf_greedy_with_logprobs
from logprobs_check import assert_top_logprobs_close, check_logprobs_close, check_outputs_equal
from pagedserve import LLM, SamplingParams

NUM_NEW_TOKENS = 32
NUM_LOGPROBS = 5


def _prompts(vocab_size: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the first ids (special tokens) so prompts look like text.
    return [[rng.randrange(8, vocab_size) for _ in range(n)] for n in lengths]


def _run_pagedserve(folder: str, prompts: list[list[int]], dtype: str, **engine_kwargs):
    llm = LLM(folder, dtype=dtype, max_model_len=256, num_kv_blocks=256, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=NUM_LOGPROBS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        assert len(completion.token_ids) == NUM_NEW_TOKENS
        step_logprobs = [{token_id: lp.logprob for token_id, lp in step.items()} for step in completion.logprobs]
        results.append((completion.token_ids, step_logprobs))
    return results


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "qwen2", "qwen3", "mistral"])
def test_float32_greedy_equals_transformers(tiny_model_dir, kind: str) -> None:
    folder = tiny_model_dir(kind)
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(folder).vocab_size
    # Lengths straddle block boundaries (16) and, for mistral, exceed the sliding window (16).
    prompts = _prompts(vocab_size, (5, 16, 17, 40, 70))
    expected = hf_greedy_with_logprobs(folder, prompts, NUM_NEW_TOKENS, NUM_LOGPROBS)
    actual = _run_pagedserve(folder, prompts, "float32", max_num_seqs=4)
    check_outputs_equal([t for t, _ in expected], [t for t, _ in actual])
    for (_, expected_steps), (_, actual_steps) in zip(expected, actual):
        for expected_top, actual_top in zip(expected_steps, actual_steps):
            # The sampled token is part of our dict too; compare the top-N values.
            assert_top_logprobs_close(expected_top, actual_top, atol=1e-3)


@pytest.mark.parametrize("kind", ["llama-rope-llama3", "llama-rope-yarn", "llama-rope-dynamic",
                                  "llama-rope-linear"])
def test_rope_scaling_greedy_equals_transformers(tiny_model_dir, kind: str) -> None:
    folder = tiny_model_dir(kind)
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(folder).vocab_size
    prompts = _prompts(vocab_size, (9, 33), seed=1)
    expected = hf_greedy_with_logprobs(folder, prompts, NUM_NEW_TOKENS, NUM_LOGPROBS)
    actual = _run_pagedserve(folder, prompts, "float32")
    check_outputs_equal([t for t, _ in expected], [t for t, _ in actual])


def test_bfloat16_logprobs_close_to_transformers(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama", dtype=torch.bfloat16)
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(folder).vocab_size
    prompts = _prompts(vocab_size, (7, 30, 50), seed=2)
    expected = hf_greedy_with_logprobs(folder, prompts, NUM_NEW_TOKENS, NUM_LOGPROBS, dtype=torch.bfloat16)
    actual = _run_pagedserve(folder, prompts, "bfloat16")
    check_logprobs_close(expected, actual)
