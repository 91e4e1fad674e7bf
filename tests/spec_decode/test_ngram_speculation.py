"""ngram speculative decoding end to end on a tiny float32 llama: lossless against the same engine without
speculation (which tests/e2e/test_hf_parity.py holds to HF transformers), under chunked prefill, preemption,
prefix caching, stop conditions, logprobs and seeded sampling; the counters it reports."""
from __future__ import annotations

import pytest

from generation_helpers import count_stack_verifications, generated_token_ids, random_prompts
from pagedserve import LLM, SamplingParams
from pagedserve.engine.metrics_reader import Counter, Vector

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _repetitive_prompts(num: int, seed: int) -> list[list[int]]:
    """Prompts that quote themselves (a random passage twice, then its start), so prompt lookup finds drafts."""
    prompts = []
    for passage, prefix in zip(random_prompts(num, 12, 30, seed), random_prompts(num, 1, 6, seed + 1)):
        prompts.append(prefix + passage + prefix + passage + prefix + passage[:3])
    return prompts


def _ngram(num_speculative_tokens: int, **extra: object) -> dict[str, object]:
    return {"method": "ngram", "num_speculative_tokens": num_speculative_tokens, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, **extra}


def _metrics(llm: LLM) -> dict[str, object]:
    return {metric.name: metric for metric in llm.get_metrics()}


@pytest.fixture(scope="module")
def folder(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(folder: str) -> dict[str, list[list[int]]]:
    llm = LLM(folder, max_model_len=256, num_kv_blocks=256)
    return {"repetitive": generated_token_ids(llm, _repetitive_prompts(4, seed=3), GREEDY),
            "random": generated_token_ids(llm, random_prompts(4, 5, 40, seed=4), GREEDY)}


@pytest.mark.parametrize("num_speculative_tokens", [1, 3, 5])
def test_greedy_output_equals_no_speculation(folder, reference, num_speculative_tokens: int) -> None:
    llm = LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_ngram(num_speculative_tokens))
    assert generated_token_ids(llm, _repetitive_prompts(4, seed=3), GREEDY) == reference["repetitive"]
    assert generated_token_ids(llm, random_prompts(4, 5, 40, seed=4), GREEDY) == reference["random"]
    metrics = _metrics(llm)
    num_drafts = metrics["vllm:spec_decode_num_drafts"]
    num_draft_tokens = metrics["vllm:spec_decode_num_draft_tokens"]
    num_accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
    per_position = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(num_drafts, Counter) and isinstance(per_position, Vector)
    # Tiny random models fall into loops that prompt lookup predicts: drafts are made and many are accepted.
    assert num_drafts.value > 0 and num_draft_tokens.value >= num_drafts.value
    assert 0 < num_accepted.value <= num_draft_tokens.value
    assert len(per_position.values) <= num_speculative_tokens
    assert sum(per_position.values) == num_accepted.value
    # Acceptance is a prefix: position j is accepted only after position j - 1 was.
    assert all(a >= b for a, b in zip(per_position.values, per_position.values[1:]))


def test_greedy_equal_under_chunked_prefill_preemption_and_prefix_cache(folder, reference) -> None:
    """Small token budget (prefills in chunks, drafts cut by the budget) and few KV blocks (preemptions)."""
    llm = LLM(folder, max_model_len=160, num_kv_blocks=24, block_size=8, max_num_batched_tokens=16,
              speculative_config=_ngram(4))
    prompts = _repetitive_prompts(4, seed=3)
    assert generated_token_ids(llm, prompts, GREEDY) == reference["repetitive"]
    stats = llm.llm_engine.engine_core.make_stats()
    assert stats.num_preemptions > 0, "the test must force preemptions"
    assert stats.spec_decode_num_accepted_tokens > 0
    # Prefix cache hits on the second pass read KV written by verification steps.
    assert generated_token_ids(llm, prompts, GREEDY) == reference["repetitive"]
    assert llm.llm_engine.engine_core.make_stats().prefix_cache_hits > stats.prefix_cache_hits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_verification_runs_on_the_decode_stack(folder, reference, monkeypatch, dtype: str) -> None:
    """Plain greedy verifications run as one native call (the layers and the LM head's argmax of every token:
    NativeDecodeForward.greedy_targets) with the same tokens as without speculation and as the modules' verification
    (native_decode_stack=False); a request asking for logprobs keeps the modules' verification."""
    prompts = _repetitive_prompts(4, seed=3)
    options = dict(dtype=dtype, max_model_len=256, num_kv_blocks=256)
    expected = reference["repetitive"] if dtype == "float32" else \
        generated_token_ids(LLM(folder, **options), prompts, GREEDY)
    llm = LLM(folder, **options, speculative_config=_ngram(3))
    taken = count_stack_verifications(llm, monkeypatch)
    assert generated_token_ids(llm, prompts, GREEDY) == expected
    assert taken and max(taken) > len(prompts)  # steps with drafts: more rows than requests
    modules = LLM(folder, **options, speculative_config=_ngram(3), native_decode_stack=False)
    assert generated_token_ids(modules, prompts, GREEDY) == expected
    taken.clear()
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    assert generated_token_ids(llm, prompts[:1], with_logprobs) == expected[:1]
    assert taken == []


def test_limits_stop_and_logprobs(folder) -> None:
    """max_tokens and max_model_len are never exceeded; a stop token ends the output at once; logprobs come for
    every emitted token, equal to those without speculation."""
    prompts = _repetitive_prompts(3, seed=5)
    plain = LLM(folder, max_model_len=128, num_kv_blocks=256)
    speculative = LLM(folder, max_model_len=128, num_kv_blocks=256, speculative_config=_ngram(5))
    for max_tokens in (1, 2, 7):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = generated_token_ids(speculative, prompts, params)
        assert outputs == generated_token_ids(plain, prompts, params)
        assert all(len(tokens) == max_tokens for tokens in outputs)
    # max_model_len: generation runs into the model length.
    long_params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)  # up to max_model_len
    outputs = generated_token_ids(speculative, prompts, long_params)
    assert outputs == generated_token_ids(plain, prompts, long_params)
    assert all(len(p) + len(o) == 128 for p, o in zip(prompts, outputs))
    # A stop token taken from the plain output, deep enough to land inside an accepted run of drafts.
    reference = generated_token_ids(plain, prompts[:1], GREEDY)[0]
    stop_token = reference[20]
    stop_params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_token])
    stopped = generated_token_ids(speculative, prompts[:1], stop_params)[0]
    assert stopped == reference[:reference.index(stop_token) + 1]
    logprob_params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    with_spec = speculative.generate([{"prompt_token_ids": p} for p in prompts], logprob_params, use_tqdm=False)
    without = plain.generate([{"prompt_token_ids": p} for p in prompts], logprob_params, use_tqdm=False)
    for a, b in zip(with_spec, without):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.outputs[0].logprobs) == len(a.outputs[0].token_ids)
        for position_a, position_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert position_a.keys() == position_b.keys()
            for token_id in position_a:
                assert position_a[token_id].logprob == pytest.approx(position_b[token_id].logprob, abs=1e-4)


def test_penalties_see_the_drafts_before_them(folder) -> None:
    """Repetition/frequency penalties and min_tokens at each verified position count the drafts before it, so
    greedy output with penalties equals the output without speculation."""
    prompts = _repetitive_prompts(3, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.2, presence_penalty=0.1)
    plain = LLM(folder, max_model_len=256, num_kv_blocks=256)
    speculative = LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_ngram(4))
    assert generated_token_ids(speculative, prompts, params) == generated_token_ids(plain, prompts, params)


def test_seeded_sampling_same_alone_and_batched(folder) -> None:
    """A seeded random request gives the same tokens alone or among other requests, with speculation on."""
    llm = LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_ngram(3))
    prompts = _repetitive_prompts(4, seed=9)
    seeded = SamplingParams(temperature=0.8, top_k=20, max_tokens=32, ignore_eos=True, seed=1234)
    alone = generated_token_ids(llm, prompts[:1], seeded)[0]
    others = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], [seeded, others, others, others],
                           use_tqdm=False)
    assert batched[0].outputs[0].token_ids == alone


@pytest.mark.parametrize("bad, message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens=17"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method='medusa'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sampler_config": {"enable_block_verify": True}},
     "enable_block_verify=true needs"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4"),
    ({"method": "ngram", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [[1, 8, 5]]},
     "K=5"),
    ({"method": "ngram", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [[1, 8, 2], [4, 9, 1]]},
     "overlap"),
    ({"method": "ngram", "num_speculative_tokens": 2, "color": "red"}, "unknown keys ['color']"),
    ({"num_speculative_tokens": 2}, "no method"),
])
def test_bad_speculative_config_is_a_clear_error(folder, bad, message) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        LLM(folder, max_model_len=256, num_kv_blocks=64, speculative_config=bad)


def test_async_scheduling_is_rejected_naming_both_knobs(folder) -> None:
    with pytest.raises(ValueError, match="async_scheduling=True") as error:
        LLM(folder, max_model_len=256, num_kv_blocks=64, async_scheduling=True, speculative_config=_ngram(2))
    assert "speculative_config" in str(error.value)


def test_batch_size_table_turns_speculation_off(folder, reference) -> None:
    """K = 0 for batches of 2 or more: a batch of 4 never drafts, a single request does."""
    config = _ngram(3, num_speculative_tokens_per_batch_size=[[2, 64, 0]])
    llm = LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=config)
    prompts = _repetitive_prompts(4, seed=3)
    # While all four run, nothing is drafted; the last one left alone drafts again, so compare counts.
    assert generated_token_ids(llm, prompts, GREEDY) == reference["repetitive"]
    batched_drafts = _metrics(llm)["vllm:spec_decode_num_drafts"].value
    generated_token_ids(llm, prompts[:1], GREEDY)
    alone_drafts = _metrics(llm)["vllm:spec_decode_num_drafts"].value - batched_drafts
    assert batched_drafts == 0 and alone_drafts > 0


def test_tensor_parallel_2_equals_one_process(folder, reference) -> None:
    """TP=2 over the 'mp' executor: every rank verifies the same gathered logits with the same randomness, so the
    ranks' batches stay identical; greedy equals the reference, seeded sampling equals one process with
    speculation."""
    tp2 = LLM(folder, max_model_len=256, num_kv_blocks=256, tensor_parallel_size=2, speculative_config=_ngram(3))
    try:
        prompts = _repetitive_prompts(4, seed=3)
        assert generated_token_ids(tp2, prompts, GREEDY) == reference["repetitive"]
        seeded = [SamplingParams(temperature=0.9, top_k=20, seed=21 + i, max_tokens=24, ignore_eos=True)
                  for i in range(len(prompts))]
        one = LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_ngram(3))
        assert generated_token_ids(tp2, prompts, seeded) == generated_token_ids(one, prompts, seeded)
        assert _metrics(tp2)["vllm:spec_decode_num_accepted_tokens"].value > 0
    finally:
        tp2.llm_engine.shutdown()


def test_streaming_stop_strings_and_n(folder) -> None:
    """Delta streaming gets several tokens per step, in order (joined, they are the final output); a stop string
    met inside accepted drafts ends the text there, as without speculation; n > 1 works."""
    from pagedserve.engine.llm_engine import LLMEngine

    prompts = _repetitive_prompts(2, seed=13)
    speculative = LLMEngine.from_kwargs(folder, max_model_len=256, num_kv_blocks=256,
                                        speculative_config=_ngram(4))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    speculative.add_request("stream", {"prompt_token_ids": prompts[0]}, params, output_kind="delta")
    deltas: list[list[int]] = []
    while speculative.has_unfinished_requests():
        for output in speculative.step():
            deltas.append(list(output.outputs[0].token_ids))
    plain = LLM(folder, max_model_len=256, num_kv_blocks=256)
    expected = generated_token_ids(plain, prompts[:1], params)[0]
    assert [token for delta in deltas for token in delta] == expected
    assert max(len(delta) for delta in deltas) > 1, "speculation must emit several tokens in some step"

    llm = LLM(folder, max_model_len=256, num_kv_blocks=256, speculative_config=_ngram(4))
    full_text = plain.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)[0].outputs[0].text
    start = next(i for i in range(len(full_text) // 2, len(full_text)) if full_text[i:i + 3].strip() == full_text[i:i + 3])
    stop = full_text[start:start + 3]
    stop_params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=[stop])
    expected_text = plain.generate([{"prompt_token_ids": prompts[1]}], stop_params, use_tqdm=False)[0]
    got = llm.generate([{"prompt_token_ids": prompts[1]}], stop_params, use_tqdm=False)[0]
    assert got.outputs[0].text == expected_text.outputs[0].text and len(got.outputs[0].text) < len(full_text)
    assert got.outputs[0].finish_reason == "stop"
    several = SamplingParams(n=3, temperature=0.9, max_tokens=16, ignore_eos=True, seed=5)
    outputs = llm.generate([{"prompt_token_ids": prompts[0]}], several, use_tqdm=False)[0].outputs
    assert len(outputs) == 3 and all(len(o.token_ids) == 16 for o in outputs)
