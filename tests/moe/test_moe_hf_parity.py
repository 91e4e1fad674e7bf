"""MoE and MLA models vs HF transformers on tiny random checkpoints: float32 greedy tokens over 32 steps."""
from __future__ import annotations

import random

import pytest

from hf_reference import hf_greedy_with_logprobs
from logprobs_check import assert_top_logprobs_close, check_outputs_equal
from pagedserve import LLM, SamplingParams
from tiny_models import MOE_KINDS

NUM_NEW_TOKENS = 32
NUM_LOGPROBS = 5


def _prompts(vocab_size: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab_size) for _ in range(n)] for n in lengths]


def run_greedy(folder: str, prompts: list[list[int]], **engine_kwargs):
    llm = LLM(folder, dtype="float32", max_model_len=256, num_kv_blocks=128, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=NUM_LOGPROBS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        steps = [{token_id: lp.logprob for token_id, lp in step.items()} for step in completion.logprobs]
        results.append((list(completion.token_ids), steps))
    return results


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_float32_greedy_equals_transformers(tiny_model_dir, kind: str) -> None:
    folder = tiny_model_dir(kind)
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(folder).vocab_size
    # 17 and 40 straddle block boundaries (16); several requests batch decodes together.
    prompts = _prompts(vocab_size, (5, 17, 40))
    expected = hf_greedy_with_logprobs(folder, prompts, NUM_NEW_TOKENS, NUM_LOGPROBS)
    actual = run_greedy(folder, prompts, max_num_seqs=4)
    check_outputs_equal([t for t, _ in expected], [t for t, _ in actual])
    for (_, expected_steps), (_, actual_steps) in zip(expected, actual):
        for expected_top, actual_top in zip(expected_steps, actual_steps):
            assert_top_logprobs_close(expected_top, actual_top, atol=1e-3)
