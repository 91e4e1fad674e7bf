"""On/off equivalence for structured outputs on the default model.

A constraint that admits exactly the unconstrained greedy output leaves it unchanged (the mask removes no
token greedy decoding picks); and constrained greedy outputs are the same with async scheduling, forced
preemption and small prefill chunks all on as in the plain engine.
"""
from __future__ import annotations

import json

import pytest

from default_model_prompts import DEFAULT_MODEL_KWARGS, chat_prompt
from schema_suite import SCHEMA_SUITE

from pagedserve import LLM, SamplingParams
from pagedserve.kernels.cpu_library import is_native_extension_available
from pagedserve.structured_output.structured_outputs_params import StructuredOutputsParams

QUESTIONS = ["Give two colors in JSON.", "A line in JSON, please.", "Size in JSON."]
SCHEMAS = ["array_min_max_items", "ref", "enum"]


def test_a_constraint_admitting_the_greedy_output_does_not_change_it(default_llm):
    prompts = [chat_prompt(default_llm, q) for q in QUESTIONS[:2]]
    plain = default_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                                 use_tqdm=False)
    params = [SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(
        choice=[o.outputs[0].text])) for o in plain]
    constrained = default_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in constrained] == [o.outputs[0].token_ids for o in plain]


def _constrained_greedy(llm: LLM) -> list[list[int]]:
    prompts = [chat_prompt(llm, q) for q in QUESTIONS]
    params = [SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=StructuredOutputsParams(
        json=SCHEMA_SUITE[name])) for name in SCHEMAS]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, name in zip(outputs, SCHEMAS):
        assert output.outputs[0].finish_reason == "stop"
        json.loads(output.outputs[0].text)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(default_llm) -> list[list[int]]:
    """The plain engine's constrained greedy outputs."""
    return _constrained_greedy(default_llm)


def test_async_scheduling_preemption_and_chunked_prefill_give_the_same_outputs(reference):
    # 9 blocks of 16 tokens for 3 requests of ~30-token prompts and up to 64 outputs: they preempt each other.
    kwargs = dict(DEFAULT_MODEL_KWARGS, max_model_len=128, num_kv_blocks=9, async_scheduling=True,
                  max_num_batched_tokens=24,
                  enable_prefix_caching=False)
    llm = LLM(**kwargs)
    try:
        assert _constrained_greedy(llm) == reference
        metrics = {metric.name: metric for metric in llm.get_metrics()}
        assert metrics["vllm:num_preemptions"].value > 0
    finally:
        llm.llm_engine.shutdown()


def test_speculative_decoding_gives_the_same_constrained_outputs(reference):
    """ngram drafts for constrained requests: the matcher trims drafts the grammar forbids, verification masks each
    draft position, and the accepted tokens advance the matcher several per step; greedy outputs are unchanged."""
    llm = LLM(**DEFAULT_MODEL_KWARGS, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                          "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    try:
        assert _constrained_greedy(llm) == reference
        metrics = {metric.name: metric for metric in llm.get_metrics()}
        assert metrics["vllm:spec_decode_num_accepted_tokens"].value > 0
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.skipif(not is_native_extension_available(),
                    reason="the native kernels are not built here (PAGEDSERVE_CPU_ISA=none or no compiler): no greedy "
                           "head takes a bitmask, the logits path is the only one")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_heads_pick_allowed_tokens_as_the_masked_logits(dtype):
    """Greedy constrained decode steps take the native decode stack's greedy rows, the grammar bitmask going into the
    LM head's argmax (float32: the GGUF head's logits masked per row; bfloat16, the weights dequantized and tile
    packed: amx_linear_first_argmax's epilogue where the CPU runs it); the outputs equal those of the logits path
    (logits, xgrammar's mask, the sampler)."""
    llm = LLM(**DEFAULT_MODEL_KWARGS, dtype=dtype, gguf_dequantize=dtype == "bfloat16")
    try:
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        # Every native build has a bf16 tile-packed unit and the float32 GGUF head: the stack's greedy step is on.
        assert runner.greedy_decode is not None
        fused = _constrained_greedy(llm)
        assert runner.forward.num_greedy_steps > 0
        runner.greedy_decode = None
        runner.fused_greedy_sample.is_enabled = False
        assert _constrained_greedy(llm) == fused
    finally:
        llm.llm_engine.shutdown()
