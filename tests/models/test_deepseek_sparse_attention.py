"""DeepSeek-V3.2 and GLM-5 (DeepSeek sparse attention) against HF transformers on tiny random checkpoints: float32
greedy tokens over 32 steps, in the sparse regime (index_topk 8, below the prompt lengths) and the dense one
(index_topk above every context, where the models also equal dense MLA: the same weights as DeepSeek-V3), and with
chunked prefill, prefix caching and preemption forced. GLM-5's tiny model has a "shared" layer between two full ones.
With kv_cache_dtype="int8" (C8): greedy tokens stay the float model's top choice given their own prefix (agreement
and log-probability regret against transformers), chunked prefill and prefix caching equal the plain C8 run, and a
max_model_len that needs the float cache's full size fits in 80% of it.
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


# C8 (kv_cache_dtype="int8"): int8 index keys move tokens across the top-k boundary, so the measure is agreement with
# the float model given the run's own prefix, not equal tokens (a correct int8 cache simulated on transformers:
# 0.83 and 0.044 nats).
C8_MIN_TOP_CHOICE_AGREEMENT = 0.78
C8_MAX_MEAN_REGRET_NATS = 0.06


def _float_scores(folder: str, prompts: list[list[int]], generated: list[list[int]]) -> tuple[float, float]:
    """Top-choice agreement and mean log-probability regret of `generated` under the float32 transformers model:
    at each generated position, whether the token is the float model's argmax given the same prefix, and
    log p(argmax) - log p(token)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    num_agreeing, regret, num_positions = 0, 0.0, 0
    for prompt, tokens in zip(prompts, generated):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0].float()
        logprobs = torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)], dim=-1)
        chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
        best = logprobs.max(dim=-1).values
        num_agreeing += int((chosen == best).sum())
        regret += float((best - chosen).sum())
        num_positions += len(tokens)
    return num_agreeing / num_positions, regret / num_positions


@pytest.mark.parametrize("kind", DSA_KINDS)
def test_c8_greedy_stays_the_float_models_top_choice(tiny_model_dir, kind: str) -> None:
    from pagedserve.attention.sparse_int8_cache import is_sparse_int8_cache
    from pagedserve.layers.sparse_mla_attention import SparseMLAAttention

    folder = tiny_model_dir(kind)
    llm = _engine(folder, max_num_seqs=4, kv_cache_dtype="int8")
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    layers = [module for module in model.modules() if isinstance(module, SparseMLAAttention)]
    assert layers and all(is_sparse_int8_cache(layer.kv_cache) for layer in layers)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    generated = [list(o.outputs[0].token_ids) for o in outputs]
    # The int8 engine's own logprobs name its greedy token as its top choice at every step.
    for output in outputs:
        for token, step in zip(output.outputs[0].token_ids, output.outputs[0].logprobs):
            assert step[token].rank == 1
    agreement, regret = _float_scores(folder, PROMPTS, generated)
    print(f"{kind} C8: top-choice agreement {agreement:.3f}, mean regret {regret:.4f} nats over "
          f"{len(PROMPTS) * NUM_NEW_TOKENS} positions")
    assert agreement >= C8_MIN_TOP_CHOICE_AGREEMENT and regret <= C8_MAX_MEAN_REGRET_NATS, (agreement, regret)
    # Agreement 1 would mean the float model's greedy tokens: the int8 cache does change the run.
    assert agreement < 1.0


def test_c8_with_chunked_prefill_and_prefix_caching_equals_plain_c8(tiny_model_dir) -> None:
    """C8 reads every context back from the cache, so chunks and prefix-cache hits see what one pass saw (GLM-5's
    tiny model: full and shared layers)."""
    folder = tiny_model_dir("glm-moe-dsa")
    plain = _generate(_engine(folder, max_num_seqs=4, kv_cache_dtype="int8"))
    llm = _engine(folder, kv_cache_dtype="int8", enable_prefix_caching=True, enable_chunked_prefill=True,
                  max_num_batched_tokens=16)
    assert _generate(llm) == plain
    hits_before = llm.llm_engine.engine_core.make_stats().prefix_cache_hits
    assert _generate(llm) == plain
    assert llm.llm_engine.engine_core.make_stats().prefix_cache_hits - hits_before >= 3 * 32


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_c8_fits_a_max_model_len_in_80_percent_of_the_float_cache(tiny_model_dir, dtype: str) -> None:
    """The memory a float cache needs for one max_model_len sequence: 80% of it refuses that max_model_len in
    float and holds it (and runs it) in int8."""
    folder = tiny_model_dir("deepseek-v32")
    max_model_len = 128
    num_needed_blocks = max_model_len // 16 + 1  # block 0 is the null block

    def engine(**kwargs) -> LLM:
        return LLM(folder, dtype=dtype, max_model_len=max_model_len, enable_prefix_caching=False, **kwargs)

    float_info = engine(num_kv_blocks=num_needed_blocks).llm_engine.engine_core.runtime_info
    full_size = float_info.kv_cache_bytes
    with pytest.raises(ValueError, match=f"fewer than max_model_len={max_model_len}"):
        engine(kv_cache_memory=int(0.8 * full_size))
    int8 = engine(kv_cache_memory=int(0.8 * full_size), kv_cache_dtype="int8")
    int8_info = int8.llm_engine.engine_core.runtime_info
    assert int8_info.num_kv_blocks >= num_needed_blocks
    float_block_bytes = full_size // num_needed_blocks
    int8_block_bytes = int8_info.kv_cache_bytes // int8_info.num_kv_blocks
    print(f"{dtype}: {float_block_bytes} bytes per block float, {int8_block_bytes} C8 "
          f"({int8_block_bytes / float_block_bytes:.2f}x)")
    assert int8_block_bytes <= 0.8 * float_block_bytes
    # A max_model_len sequence runs in it.
    prompt = PROMPTS[-1] * 3
    prompt = prompt[:max_model_len - 8]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    output = int8.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 8


def test_c8_refuses_an_index_head_dim_that_is_no_power_of_two(tiny_model_dir) -> None:
    folder = tiny_model_dir("deepseek-v32", index_head_dim=24)
    _engine(folder)  # the float cache has no rotation
    with pytest.raises(ValueError, match="index_head_dim=24 must be a power of two"):
        _engine(folder, kv_cache_dtype="int8")


# GLM-5 over TP=2 is slow-marked: its multi-rank path runs in
# test_c8_and_expert_parallel_over_two_ranks_equal_one_process.
@pytest.mark.parametrize("kind", [pytest.param(kind, marks=pytest.mark.slow) if kind == "glm-moe-dsa" else kind
                                  for kind in DSA_KINDS])
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


def test_c8_and_expert_parallel_over_two_ranks_equal_one_process(tiny_model_dir) -> None:
    """C8 pages under tensor_parallel_size=2 (each rank holds the whole latent and index keys, quantized alike), and
    the float model with its experts split over the two ranks (enable_expert_parallel), each equal to one process."""
    folder = tiny_model_dir("glm-moe-dsa")
    prompts = PROMPTS[1:3]
    cases = [dict(kv_cache_dtype="int8"), dict(enable_expert_parallel=True)]
    for kwargs in cases:
        single = _generate(_engine(folder, kv_cache_dtype=kwargs.get("kv_cache_dtype", "auto")), prompts)
        sharded_llm = _engine(folder, tensor_parallel_size=2, **kwargs)
        try:
            sharded = _generate(sharded_llm, prompts)
        finally:
            sharded_llm.llm_engine.shutdown()
        assert sharded == single, kwargs


@pytest.mark.parametrize("kind", ["deepseek-v32", pytest.param("glm-moe-dsa", marks=pytest.mark.slow)])
def test_bfloat16_logprobs_close_to_transformers(tiny_model_dir, kind: str) -> None:
    """bf16 weights and compute on both sides (sparse regime): at the first token where the greedy runs differ, each
    side's token is in the other's top 5 logprobs. (GLM-5's layers are DeepSeek-V3.2's plus shared selections, which
    its float32 tests cover: with `-m slow`.)"""
    from logprobs_check import check_logprobs_close

    folder = tiny_model_dir(kind, dtype=torch.bfloat16)
    prompts = PROMPTS[:3]
    expected = hf_greedy_with_logprobs(folder, prompts, NUM_NEW_TOKENS, 5, dtype=torch.bfloat16)
    llm = LLM(folder, dtype="bfloat16", max_model_len=256, num_kv_blocks=128, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    actual = [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in step.items()} for step in
                                              o.outputs[0].logprobs]) for o in outputs]
    check_logprobs_close(expected, actual)
