"""Bad input: a ValueError naming the field, the value and the limit; the engine stays usable."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from pagedserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir("llama"), num_kv_blocks=64, max_model_len=256)


def _ok(llm: LLM) -> None:
    out = llm.generate({"prompt_token_ids": [10, 11, 12]}, SamplingParams(temperature=0.0, max_tokens=3,
                                                                           ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("prompt, params, fragments", [
    ({"prompt_token_ids": list(range(8, 208))}, SamplingParams(max_tokens=100), ["200", "100", "256"]),
    ({"prompt_token_ids": list(range(8, 264))}, SamplingParams(max_tokens=1), ["256"]),
    ({"prompt_token_ids": []}, SamplingParams(max_tokens=4), ["empty"]),
    ("", SamplingParams(max_tokens=4), ["empty"]),
    ({"prompt_token_ids": [5, 10**6]}, SamplingParams(max_tokens=4), ["1000000", "vocab"]),
    ({"prompt_token_ids": [5, -1]}, SamplingParams(max_tokens=4), ["-1"]),
])
def test_bad_prompts(llm: LLM, prompt, params, fragments) -> None:
    with pytest.raises(ValueError) as error:
        llm.generate(prompt, params, use_tqdm=False)
    for fragment in fragments:
        assert fragment in str(error.value), (fragment, str(error.value))
    _ok(llm)


@pytest.mark.parametrize("kwargs, fragments", [
    (dict(temperature=-0.5), ["temperature", "-0.5"]),
    (dict(top_p=0.0), ["top_p", "0.0", "(0, 1]"]),
    (dict(top_p=1.5), ["top_p", "1.5"]),
    (dict(top_k=-2), ["top_k", "-2"]),
    (dict(n=0), ["n=0", ">= 1"]),
    (dict(logprobs=21), ["logprobs", "21", "20"]),
    (dict(prompt_logprobs=50), ["prompt_logprobs", "50", "20"]),
    (dict(max_tokens=0), ["max_tokens", "0", ">= 1"]),
    (dict(min_p=2.0), ["min_p", "2.0"]),
])
def test_bad_sampling_params(kwargs, fragments) -> None:
    with pytest.raises(ValueError) as error:
        SamplingParams(**kwargs)
    for fragment in fragments:
        assert fragment in str(error.value), (fragment, str(error.value))


def test_top_k_zero_means_disabled() -> None:
    # vLLM accepts 0 as "disabled" (-1 too); only values below -1 are rejected.
    assert SamplingParams(top_k=0).top_k == -1


def test_missing_folder_and_missing_weights(tmp_path, tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="no such folder"):
        LLM(str(tmp_path / "does-not-exist"))
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir("llama"), no_weights)
    for name in os.listdir(no_weights):
        if name.endswith(".safetensors"):
            os.remove(no_weights / name)
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(no_weights))


def test_unsupported_architecture(tmp_path, tiny_model_dir) -> None:
    folder = tmp_path / "weird"
    shutil.copytree(tiny_model_dir("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        LLM(str(folder))
    assert "GPT2LMHeadModel" in str(error.value) and "LlamaForCausalLM" in str(error.value)


def test_unsupported_dtype(tiny_model_dir) -> None:
    with pytest.raises(ValueError) as error:
        LLM(tiny_model_dir("llama"), dtype="float16")
    assert "float16" in str(error.value) and "cpu" in str(error.value)
    with pytest.raises(ValueError, match="dtype='int3'"):
        LLM(tiny_model_dir("llama"), dtype="int3")


def test_bad_engine_knobs(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="max_model_len=100000"):
        LLM(folder, max_model_len=100000)
    with pytest.raises(ValueError, match="block_size=0"):
        LLM(folder, block_size=0)
    with pytest.raises(ValueError, match=r"num_kv_blocks=4\).*fewer than max_model_len="):
        LLM(folder, num_kv_blocks=4)
    with pytest.raises(ValueError, match="kv_cache_memory='lots'"):
        LLM(folder, kv_cache_memory="lots")
    with pytest.raises(ValueError, match="max_num_batched_tokens=64"):
        LLM(folder, enable_chunked_prefill=False, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="num_cpu_threads=0"):
        LLM(folder, num_cpu_threads=0)
    assert torch.get_default_dtype() == torch.float32
