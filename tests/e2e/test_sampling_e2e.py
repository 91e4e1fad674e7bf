"""Sampling features through the whole engine: seeds, n > 1, logprobs, stops, text prompts, chat."""
from __future__ import annotations

import random

import pytest

from pagedserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir("llama"), max_model_len=256, num_kv_blocks=256)


def _prompts(num: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(8, 400) for _ in range(rng.randint(4, 40))]} for _ in range(num)]


def test_seed_same_alone_and_in_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    prompt = _prompts(1, seed=7)[0]
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = _prompts(7, seed=8)
    unseeded = SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True)
    batch = others[:3] + [prompt] + others[3:]
    params = [unseeded] * 3 + [seeded] + [unseeded] * 4
    in_batch = llm.generate(batch, params, use_tqdm=False)[3].outputs[0].token_ids
    assert in_batch == alone
    # A different seed gives different tokens (20 tokens from a ~500-token vocab).
    other_seed = seeded.clone(seed=99)
    assert llm.generate(prompt, other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_greater_than_one(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    output = llm.generate(_prompts(1, seed=1)[0], params, use_tqdm=False)[0]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in output.outputs)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    greedy = llm.generate(_prompts(1, seed=1)[0], SamplingParams(n=2, temperature=0.0, max_tokens=8,
                                                                   ignore_eos=True), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_logprobs_and_prompt_logprobs(llm: LLM) -> None:
    prompt = _prompts(1, seed=2)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    output = llm.generate(prompt, params, use_tqdm=False)[0]
    completion = output.outputs[0]
    assert len(completion.logprobs) == 6
    for token_id, step in zip(completion.token_ids, completion.logprobs):
        assert token_id in step
        assert step[token_id].rank == 1  # greedy picks the top token
        assert 3 <= len(step) <= 4
    assert completion.cumulative_logprob == pytest.approx(
        sum(step[t].logprob for t, step in zip(completion.token_ids, completion.logprobs)))
    prompt_ids = prompt["prompt_token_ids"]
    assert output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(prompt_ids)
    for token_id, position in zip(prompt_ids[1:], output.prompt_logprobs[1:]):
        assert token_id in position


def test_max_tokens_and_stop_token_ids(llm: LLM) -> None:
    prompt = _prompts(1, seed=3)[0]
    free_run = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    assert free_run.finish_reason == "length"
    stop_token = free_run.token_ids[4]
    first_index = free_run.token_ids.index(stop_token)
    stopped = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                  stop_token_ids=[stop_token]), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason == stop_token
    assert stopped.token_ids == free_run.token_ids[:first_index + 1]


def test_stop_string(llm: LLM) -> None:
    prompt = _prompts(1, seed=4)[0]
    free_run = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    text = free_run.text
    assert len(text) >= 6, text
    stop = text[3:6]
    start = text.find(stop)
    stopped = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason == stop
    assert stopped.text == text[:start]
    kept = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop],
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:start + len(stop)]
    # The engine holds nothing after stop-string stops.
    assert not llm.llm_engine.has_unfinished_requests()


def test_text_prompt_and_chat(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    output = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                          use_tqdm=False)[0]
    assert output.prompt == "Hello world"
    assert output.prompt_token_ids == tokenizer("Hello world")["input_ids"]
    assert output.outputs[0].text == tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    chat = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    expected_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(expected_ids, "keys"):  # transformers 5 returns a BatchEncoding
        expected_ids = expected_ids["input_ids"]
    assert chat.prompt_token_ids == list(expected_ids)
    assert len(chat.outputs[0].token_ids) == 5
