"""DeepSeek-V3.2 and GLM-5 (DeepSeek sparse attention) against HF transformers on tiny random checkpoints: float32
greedy tokens over 32 steps, in the sparse regime (index_topk 8, below the prompt lengths) and the dense one
(index_topk above every context, where the models also equal dense MLA: the same weights as DeepSeek-V3), and with
chunked prefill, prefix caching and preemption forced. GLM-5's tiny model has a "shared" layer between two full ones.
"""
from __future__ import annotations

import json
import os
import random

import pytest
import torch
from hf_reference import hf_greedy_with_logprobs
from logprobs_check import check_outputs_equal
from tiny_models import DSA_KINDS

from pagedserve import LLM, SamplingParams

NUM_NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
DENSE_TOP_K = 128  # above every context here (prompts <= 55 tokens + 32 new)


def _prompts() -> list[list[int]]:
    """One 5-token prompt and three sharing a 35-token prefix (38, 46 and 55 tokens): all but the first exceed
    index_topk (8) and straddle block boundaries (16); the shared prefix is what prefix caching finds."""
    rng = random.Random(0)
    shared = [rng.randrange(8, 600) for _ in range(35)]
    return [[rng.randrange(8, 600) for _ in range(5)]] + [shared + [rng.randrange(8, 600) for _ in range(n)]
                                                          for n in (3, 11, 20)]


PROMPTS = _prompts()
# HF's greedy tokens per checkpoint folder: HF's tiny MoE generates slowly, so each runs once per session.
_HF_TOKENS: dict[str, list[list[int]]] = {}


def _hf_tokens(folder: str, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    key = f"{folder}:{prompts!r}"
    if key not in _HF_TOKENS:
        _HF_TOKENS[key] = [tokens for tokens, _ in hf_greedy_with_logprobs(folder, prompts, NUM_NEW_TOKENS, 1)]
    return _HF_TOKENS[key]


def _generate(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _engine(folder: str, **kwargs) -> LLM:
    kwargs = {"max_model_len": 256, "num_kv_blocks": 128, "enable_prefix_caching": False, **kwargs}
    return LLM(folder, dtype="float32", **kwargs)


@pytest.mark.parametrize("kind", DSA_KINDS)
def test_sparse_float32_greedy_equals_transformers(tiny_model_dir, kind: str) -> None:
    folder = tiny_model_dir(kind)
    actual = _generate(_engine(folder, max_num_seqs=4))
    check_outputs_equal(_hf_tokens(folder), actual)
    # Sparsity acts: with every token selected the same weights generate otherwise.
    assert _generate(_engine(tiny_model_dir(kind, index_topk=DENSE_TOP_K), max_num_seqs=4)) != actual


def _as_deepseek_v3(folder: str, target: str) -> str:
    """The same weights as a DeepSeek-V3 (dense MLA) checkpoint: the indexer tensors and keys dropped."""
    from safetensors.torch import load_file, save_file

    os.makedirs(target, exist_ok=True)
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            tensors = {key: value for key, value in load_file(os.path.join(folder, name)).items()
                       if ".indexer." not in key}
            save_file(tensors, os.path.join(target, name), metadata={"format": "pt"})
        elif name != "config.json":
            with open(os.path.join(folder, name), "rb") as source, open(os.path.join(target, name), "wb") as copy:
                copy.write(source.read())
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    for key in ("index_topk", "index_head_dim", "index_n_heads", "indexer_types", "layer_types"):
        config.pop(key, None)
    config.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", rope_interleave=True)
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(config, f)
    return target


@pytest.mark.parametrize("kind", DSA_KINDS)
def test_dense_regime_equals_transformers_and_dense_mla(tiny_model_dir, tmp_path, kind: str) -> None:
    folder = tiny_model_dir(kind, index_topk=DENSE_TOP_K)
    prompts = PROMPTS[:1] + PROMPTS[-1:]
    actual = _generate(_engine(folder), prompts)
    check_outputs_equal(_hf_tokens(folder, prompts), actual)
    dense_mla = _generate(_engine(_as_deepseek_v3(folder, str(tmp_path / "v3"))), prompts)
    check_outputs_equal(dense_mla, actual, name_0="deepseek-v3", name_1=kind)


@pytest.mark.parametrize("kind", DSA_KINDS)
def test_chunked_prefill_equals_transformers(tiny_model_dir, kind: str) -> None:
    folder = tiny_model_dir(kind)
    llm = _engine(folder, max_num_batched_tokens=16, enable_chunked_prefill=True)
    check_outputs_equal(_hf_tokens(folder), _generate(llm))


@pytest.mark.parametrize("kind", DSA_KINDS)
def test_prefix_caching_equals_transformers(tiny_model_dir, kind: str) -> None:
    folder = tiny_model_dir(kind)
    llm = _engine(folder, enable_prefix_caching=True, max_num_batched_tokens=32)
    core = llm.llm_engine.engine_core
    check_outputs_equal(_hf_tokens(folder), _generate(llm))
    hits_before = core.make_stats().prefix_cache_hits
    # The second pass reads the cached blocks' latents and index keys back from the cache.
    check_outputs_equal(_hf_tokens(folder), _generate(llm))
    assert core.make_stats().prefix_cache_hits - hits_before >= 3 * 32


@pytest.mark.parametrize("kind", DSA_KINDS)
def test_preemption_equals_transformers(tiny_model_dir, kind: str) -> None:
    folder = tiny_model_dir(kind)
    # The four requests need up to 17 blocks of 16 together; 10 force preemption by recompute.
    llm = _engine(folder, num_kv_blocks=10, max_model_len=128)
    check_outputs_equal(_hf_tokens(folder), _generate(llm))
    assert llm.llm_engine.engine_core.make_stats().num_preemptions > 0


def test_glm_shared_layer_has_no_indexer_and_no_index_keys(tiny_model_dir) -> None:
    from transformers import AutoConfig

    from pagedserve.attention.lightning_indexer import INDEX_KEY_COMPONENT
    from pagedserve.config.model import ModelConfig
    from pagedserve.model_loader import load_model

    folder = tiny_model_dir("glm-moe-dsa")
    model = load_model(ModelConfig(model=folder, dtype=torch.float32, hf_config=AutoConfig.from_pretrained(folder)),
                       "cpu")
    blocks = [layer.self_attn for layer in model.model.layers]
    assert [block.indexer is not None for block in blocks] == [True, False, True]
    specs = [block.mla_attn.kv_cache_spec() for block in blocks]
    assert [[c.name for c in spec.extra_components] for spec in specs] == [[INDEX_KEY_COMPONENT], [],
                                                                           [INDEX_KEY_COMPONENT]]
    assert blocks[1].mla_attn._selection_source[0] is blocks[0].mla_attn
    assert blocks[0].indexer.rope_permutation is not None  # GLM-5 rotates the indexer's pairs interleaved


def test_int8_kv_cache_is_refused_naming_the_knob(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is not supported for SparseMLAAttention"):
        _engine(tiny_model_dir("deepseek-v32"), kv_cache_dtype="int8")


@pytest.mark.parametrize("kind", DSA_KINDS)
def test_tensor_parallel_2_equals_one_process(tiny_model_dir, kind: str) -> None:
    """Heads split over two gloo ranks; the indexer is replicated, so both ranks select the same tokens."""
    folder = tiny_model_dir(kind)
    prompts = PROMPTS[1:3]
    single = _generate(_engine(folder), prompts)
    sharded_llm = _engine(folder, tensor_parallel_size=2)
    try:
        sharded = _generate(sharded_llm, prompts)
    finally:
        sharded_llm.llm_engine.shutdown()
    assert sharded == single
