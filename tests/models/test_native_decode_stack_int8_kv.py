"""The native decode stack over int8 KV pages (kv_cache_dtype="int8"): decode-only steps in one native call.

The stack writes each new token's K/V with the int8 quantizing write (reshape_and_cache_int8's row code) and attends
with paged_decode_attention_int8's code, as the modules do through cpu_native, so its results are bitwise theirs:
the standard of tests/models/test_native_decode_stack.py.
- On/off equivalence: the stack in one parallel region, the stack op by op (ONE_REGION_MAX_ROWS = 0) and the modules
  (native_decode_stack=False) give bitwise-equal tokens and logprobs over 40 greedy steps and leave bitwise-equal int8
  pages and scales behind, for bfloat16 (amx_packed) and float32 (plain_native) models, one row and several, prompts
  reaching past the 256-token attention partition (the region merges partitions).
- Plain greedy steps take greedy_rows (the stack and the LM head's argmax in one call) with the same tokens.
- The start-up log says the stack runs with int8 pages.
"""
from __future__ import annotations

import logging

import pytest
import torch

from generation_helpers import random_prompts
from pagedserve import LLM, SamplingParams
from pagedserve.attention.kv_quantization import kv_cache_scales
from pagedserve.kernels.cpu_library import is_native_extension_available
from pagedserve.layers.small_batch_linear import small_batch_linear_available
from pagedserve.models.native_decode_stack import NativeDecodeForward
from pagedserve.worker.kv_cache_allocation import attention_layers

pytestmark = pytest.mark.skipif(not is_native_extension_available(),
                                reason="no native kernels here (PAGEDSERVE_CPU_ISA=none, a CPU without a build, or no "
                                       "compiler): there is no decode stack")

NUM_STEPS = 40

LAYOUTS = [
    # (dtype, weight_layout): the stack's one-region kinds in each dtype
    pytest.param("bfloat16", "amx_packed", id="bfloat16"),
    pytest.param("float32", "plain_native", id="float32", marks=pytest.mark.skipif(
        not small_batch_linear_available(),
        reason="needs the small-batch float32 kernel (built at the avx2 level and above)")),
]


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def _outputs(llm: LLM, prompts: list[list[int]], **params):
    sampling = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True, **params)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    return [(o.outputs[0].token_ids, None if o.outputs[0].logprobs is None else
             [sorted((token, entry.logprob) for token, entry in step.items()) for step in o.outputs[0].logprobs])
            for o in outputs]


def _pages(llm: LLM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's int8 data and its scales' bits (copies)."""
    caches = [layer.kv_cache for layer in attention_layers(_runner(llm).model)]
    assert caches and all(cache.dtype == torch.int8 for cache in caches)
    return [(cache.clone(), kv_cache_scales(cache).view(torch.int32).clone()) for cache in caches]


def _assert_pages_equal(first, second) -> None:
    assert len(first) == len(second)
    for (data, scales), (other_data, other_scales) in zip(first, second):
        assert torch.equal(data, other_data) and torch.equal(scales, other_scales)
    assert any(scales.abs().sum() > 0 for _, scales in first)


# (dtype, weight_layout, num_prompts): one row (the second thread has none) and several.
STACK_CASES = [pytest.param(*layout.values, num_prompts, id=f"{layout.id}-{num_prompts}", marks=layout.marks)
               for layout in LAYOUTS for num_prompts in ((1, 5) if layout.id == "bfloat16" else (5,))]


@pytest.mark.parametrize("dtype,weight_layout,num_prompts", STACK_CASES)
def test_int8_stack_equals_op_by_op_and_the_modules(tiny_model_dir, monkeypatch, dtype: str, weight_layout: str,
                                                    num_prompts: int) -> None:
    import pagedserve.models.native_decode_stack as stack_module

    folder = tiny_model_dir("llama")
    prompts = random_prompts(num_prompts, 230, 250, seed=num_prompts)
    options = dict(dtype=dtype, weight_layout=weight_layout, max_model_len=512, num_kv_blocks=40 * num_prompts,
                   kv_cache_dtype="int8")
    results, pages = [], []
    for one_region_max_rows, enabled in ((stack_module.ONE_REGION_MAX_ROWS, True), (0, True), (0, False)):
        monkeypatch.setattr(stack_module, "ONE_REGION_MAX_ROWS", one_region_max_rows)
        llm = LLM(folder, native_decode_stack=enabled, **options)
        results.append(_outputs(llm, prompts, logprobs=5))
        pages.append(_pages(llm))
        forward = _runner(llm).forward
        if enabled:
            assert isinstance(forward, NativeDecodeForward)
            assert forward.num_stack_steps == NUM_STEPS - 1  # every step after the prompts' prefill
            assert forward.plan.native.num_one_region_steps() == (NUM_STEPS - 1 if one_region_max_rows else 0)
        else:
            assert not isinstance(forward, NativeDecodeForward)
    assert results[0] == results[1] == results[2]
    _assert_pages_equal(pages[0], pages[2])
    _assert_pages_equal(pages[1], pages[2])


@pytest.mark.parametrize("dtype,weight_layout", LAYOUTS)
def test_int8_greedy_steps_sample_in_the_stack(tiny_model_dir, dtype: str, weight_layout: str) -> None:
    folder = tiny_model_dir("llama")
    prompts = random_prompts(3, 230, 250, seed=11)
    options = dict(dtype=dtype, weight_layout=weight_layout, max_model_len=512, num_kv_blocks=120,
                   kv_cache_dtype="int8")
    llm = LLM(folder, **options)
    forward = _runner(llm).forward
    greedy = _outputs(llm, prompts)
    assert forward.num_greedy_steps == NUM_STEPS - 1
    modules = _outputs(LLM(folder, native_decode_stack=False, **options), prompts)
    assert greedy == modules


def test_start_up_log_says_the_stack_runs_with_int8(tiny_model_dir, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="pagedserve.models.native_decode_stack"):
        LLM(tiny_model_dir("llama"), max_model_len=256, num_kv_blocks=64, kv_cache_dtype="int8")
    assert "native decode stack: decode-only steps run" in caplog.text
    assert "not used" not in caplog.text
