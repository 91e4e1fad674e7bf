"""Fine-grained TP degrees (LM head, word embedding, o_proj) and reduce_sample equal one process."""
from __future__ import annotations

import random

import pytest

from pagedserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _prompts() -> list[dict]:
    rng = random.Random(7)
    return [{"prompt_token_ids": [rng.randrange(8, 600) for _ in range(rng.randint(3, 50))]} for _ in range(4)]


def _tokens(llm: LLM, params: SamplingParams | list[SamplingParams] = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]


def test_replicated_head_embedding_oproj_and_kv_head_replication(tiny_model_dir) -> None:
    # One KV head over two TP ranks: the KV head is replicated; LM head, embedding and o_proj run at
    # degree 1 (replicated) inside a TP=2 world, so their boundaries gather instead of reducing.
    folder = tiny_model_dir("llama", num_key_value_heads=1)
    reference = _tokens(LLM(folder, max_model_len=256, num_kv_blocks=64))
    llm = LLM(folder, max_model_len=256, num_kv_blocks=64, tensor_parallel_size=2, lmhead_tensor_parallel_size=1,
              embedding_tensor_parallel_size=1, oproj_tensor_parallel_size=1)
    try:
        assert _tokens(llm) == reference
    finally:
        llm.llm_engine.shutdown()


def test_reduce_sample_exact_for_greedy_and_top_k(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    reference = LLM(folder, max_model_len=256, num_kv_blocks=64)
    llm = LLM(folder, max_model_len=256, num_kv_blocks=64, tensor_parallel_size=2, enable_reduce_sample=True)
    try:
        assert _tokens(llm) == _tokens(reference)
        # Mixed batch: greedy rows and seeded top-k rows (with top-p and min-p on top) in one step.
        mixed = [GREEDY,
                 SamplingParams(temperature=0.8, top_k=5, seed=1, max_tokens=16, ignore_eos=True),
                 SamplingParams(temperature=1.2, top_k=40, top_p=0.9, seed=2, max_tokens=16, ignore_eos=True),
                 SamplingParams(temperature=1.0, top_k=3, min_p=0.1, seed=3, max_tokens=16, ignore_eos=True)]
        assert _tokens(llm, mixed) == _tokens(reference, mixed)
        # Where the candidate set would be approximate, the request is refused up front.
        with pytest.raises(ValueError, match="top_k"):
            llm.generate("hello", SamplingParams(temperature=1.0, top_k=-1), use_tqdm=False)
        with pytest.raises(ValueError, match="logprobs"):
            llm.generate("hello", SamplingParams(temperature=0.0, logprobs=2), use_tqdm=False)
        with pytest.raises(ValueError, match="repetition_penalty"):
            llm.generate("hello", SamplingParams(temperature=0.0, repetition_penalty=1.3), use_tqdm=False)
        assert _tokens(llm) == _tokens(reference)  # still serving
    finally:
        llm.llm_engine.shutdown()
