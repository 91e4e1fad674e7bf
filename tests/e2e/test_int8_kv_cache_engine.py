"""kv_cache_dtype="int8" end to end on a tiny random Llama (float32): answers, capacity, features, bad input.

Greedy answers: int8 K/V are not the float32 ones, so on a random model (whose logits have near-ties) a greedy
continuation may take the other branch of a near-tie. The check therefore is: at every step where the int8 run and
the "auto" run have the same context, the int8 run picks the same token unless the auto run's top-2 are within
LOGPROB_TOLERANCE of each other, and the chosen token's logprob differs by at most LOGPROB_TOLERANCE. Measured here:
the largest logprob difference is ~0.008 and one of 8 requests diverges at a near-tie (gap ~0.004); with every
scale 5% off the largest difference is ~0.07 and 6 of 8 requests diverge, which the check rejects
(test_tolerance_catches_a_wrong_scale).
"""
from __future__ import annotations

import argparse
import logging
import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.attention import kv_quantization
from pagedserve.kernels.cpu_library import is_native_extension_available

LOGPROB_TOLERANCE = 0.02
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def folder(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


def _prompts(num: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, 400) for _ in range(rng.randint(low, high))] for _ in range(num)]


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def _violations(reference, candidate) -> list[str]:
    """Where `candidate` (int8) departs from `reference` (auto) by more than a near-tie (module docstring)."""
    found = []
    for index, (expected, actual) in enumerate(zip(reference, candidate)):
        for step, (want, got) in enumerate(zip(expected.token_ids, actual.token_ids)):
            top = expected.logprobs[step]
            if want != got:
                gap = top[want].logprob - top[got].logprob if got in top else float("inf")
                if gap > LOGPROB_TOLERANCE:
                    found.append(f"request {index} step {step}: {got} instead of {want} (gap {gap:.4f})")
                break  # the contexts differ from here on
            difference = abs(top[want].logprob - actual.logprobs[step][got].logprob)
            if difference > LOGPROB_TOLERANCE:
                found.append(f"request {index} step {step}: logprob differs by {difference:.4f}")
    return found


BACKENDS = ["torch_paged"] + (["cpu_native"] if is_native_extension_available() else [])


@pytest.fixture(scope="module")
def auto_outputs(folder: str):
    prompts = _prompts(8, 10, 60, seed=0)
    return prompts, _generate(LLM(folder, max_model_len=256, num_kv_blocks=128), prompts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_greedy_matches_auto_up_to_near_ties(folder: str, auto_outputs, backend: str) -> None:
    prompts, reference = auto_outputs
    llm = LLM(folder, max_model_len=256, num_kv_blocks=128, kv_cache_dtype="int8", attention_backend=backend)
    outputs = _generate(llm, prompts)
    assert _violations(reference, outputs) == []
    # Most requests agree token for token over all 32 tokens.
    assert sum(a.token_ids == b.token_ids for a, b in zip(reference, outputs)) >= 6


def test_tolerance_catches_a_wrong_scale(folder: str, auto_outputs, monkeypatch) -> None:
    prompts, reference = auto_outputs
    quantize = kv_quantization.quantize_per_token_head

    def scales_five_percent_high(rows):
        quantized, scales = quantize(rows)
        return quantized, scales * 1.05

    monkeypatch.setattr(kv_quantization, "quantize_per_token_head", scales_five_percent_high)
    llm = LLM(folder, max_model_len=256, num_kv_blocks=128, kv_cache_dtype="int8", attention_backend="torch_paged")
    assert len(_violations(reference, _generate(llm, prompts))) >= 3


def test_int8_prefix_cache_hits_and_preemption_keep_the_answers(folder: str) -> None:
    rng = random.Random(1)
    shared = [rng.randrange(8, 400) for _ in range(40)]
    prompts = [shared + [rng.randrange(8, 400) for _ in range(rng.randint(1, 20))] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def tokens(llm: LLM) -> list[list[int]]:
        return [o.token_ids for o in _generate(llm, prompts, params)]

    reference = tokens(LLM(folder, max_model_len=256, num_kv_blocks=128, kv_cache_dtype="int8",
                           enable_prefix_caching=False))
    llm = LLM(folder, max_model_len=256, num_kv_blocks=128, kv_cache_dtype="int8")
    assert tokens(llm) == reference
    hits_before = llm.llm_engine.engine_core.make_stats().prefix_cache_hits
    assert tokens(llm) == reference  # every prompt's full blocks now come from the cache
    assert llm.llm_engine.engine_core.make_stats().prefix_cache_hits - hits_before >= 6 * 32
    # 6 requests of up to 84 tokens need up to 36 blocks together; 12 blocks force preemption (recompute).
    small = LLM(folder, max_model_len=128, num_kv_blocks=12, kv_cache_dtype="int8", max_num_batched_tokens=32)
    assert tokens(small) == reference
    assert small.llm_engine.engine_core.make_stats().num_preemptions > 0


def test_int8_capacity_and_log_line(folder: str, caplog) -> None:
    budget = 1 << 20
    with caplog.at_level(logging.INFO, logger="pagedserve.worker.worker"):
        auto = LLM(folder, max_model_len=256, kv_cache_memory=budget)
        int8 = LLM(folder, max_model_len=256, kv_cache_memory=budget, kv_cache_dtype="int8")
    # Tiny Llama: 2 layers, 2 KV heads, head_dim 16, float32, block 16. Auto: 2 * 16 * 2 * 16 * 4 bytes per layer
    # and block; int8: 2 * 16 * 2 * (16 + 4) (values + float32 scales): 3.2x the blocks.
    auto_blocks = auto.llm_engine.engine_core.runtime_info.num_kv_blocks
    int8_blocks = int8.llm_engine.engine_core.runtime_info.num_kv_blocks
    assert auto_blocks == budget // (2 * 4096)
    assert int8_blocks == budget // (2 * 1280)
    assert int8.llm_engine.engine_core.runtime_info.kv_cache_bytes == int8_blocks * 2 * 1280
    assert f"KV cache (int8): {int8_blocks} blocks of 16 tokens" in caplog.text
    assert f"max {(int8_blocks - 1) * 16} concurrent tokens" in caplog.text


def test_int8_with_batch_invariance_gives_a_request_the_same_tokens_in_any_batch(folder: str) -> None:
    """batch_invariant=True's attention reads int8 pages through the same dequantizing gather."""
    prompts = _prompts(4, 5, 50, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(folder, max_model_len=256, num_kv_blocks=128, kv_cache_dtype="int8", batch_invariant=True,
              enable_prefix_caching=False)
    together = [o.token_ids for o in _generate(llm, prompts, params)]
    alone = [_generate(llm, [prompt], params)[0].token_ids for prompt in prompts]
    assert together == alone


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "bfloat16", "float16"])
def test_unsupported_kv_cache_dtype_names_the_value_and_the_supported_ones(folder: str, value: str) -> None:
    with pytest.raises(ValueError, match=rf"kv_cache_dtype='{value}' is not supported; supported: \['auto', 'int8'\]"):
        LLM(folder, kv_cache_dtype=value)


def test_int8_mla_latent_cache_matches_auto_up_to_near_ties(tiny_model_dir) -> None:
    """DeepSeek-V2 (MLA): the latent cache in int8 with its scales, answers as the auto cache's up to near-ties."""
    folder = tiny_model_dir("deepseek-v2")
    prompts = _prompts(6, 10, 60, seed=2)
    auto = LLM(folder, max_model_len=256, num_kv_blocks=128)
    reference = _generate(auto, prompts)
    llm = LLM(folder, max_model_len=256, num_kv_blocks=128, kv_cache_dtype="int8")
    assert _violations(reference, _generate(llm, prompts)) == []
    # The pages really are int8: a quarter of the float32 latent's bytes plus two float32 scales a token (3x here).
    int8_bytes = llm.llm_engine.engine_core.runtime_info.kv_cache_bytes
    assert int8_bytes < auto.llm_engine.engine_core.runtime_info.kv_cache_bytes / 2.5


def test_int8_with_a_block_drafter_is_refused_at_start() -> None:
    """Layers that cannot read int8 pages (the DFlash / DSpark block drafter's) are refused, naming the knob."""
    from torch import nn

    from pagedserve.layers.block_draft_attention import BlockDraftAttention
    from pagedserve.worker.kv_cache_allocation import kv_bytes_per_block

    model = nn.ModuleList([BlockDraftAttention(4, 8, 0.1, 2, prefix="drafter.attn")])
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is not supported for BlockDraftAttention layers"):
        kv_bytes_per_block(model, 16, torch.float32, "int8")


def test_cli_flag() -> None:
    from pagedserve.config.cli_args import add_engine_args, engine_kwargs_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs_from_args(parser.parse_args(["--kv-cache-dtype", "int8"]))["kv_cache_dtype"] == "int8"
    assert engine_kwargs_from_args(parser.parse_args([]))["kv_cache_dtype"] == "auto"
