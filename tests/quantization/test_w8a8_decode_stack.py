"""W8A8 models on the native decode stack (linear kind 6, kernels/cpu/decode_stack.cpp): decode steps in one region,
op by op and on the modules give the same tokens and logprobs bit for bit, in float32 and bfloat16, with per-token
and static activation scales; greedy steps sample on the unquantized LM head in the stack."""
from __future__ import annotations

import pytest
from test_w8a8_models import _quantize
from tiny_models import tiny_corpus

from generation_helpers import greedy_outputs_with_logprobs, model_runner_forward, random_prompts

from pagedserve import LLM
from pagedserve.layers.quantization.int8_matmul import native_w8a8_linear
from pagedserve.models.native_decode_stack import W8A8_KIND, NativeDecodeForward

pytestmark = pytest.mark.skipif(
    native_w8a8_linear() is None,
    reason="no native CPU kernel build here (PAGEDSERVE_CPU_ISA=none, or a CPU without one): no decode stack; the "
           "modules' W8A8 path is covered by test_w8a8_models.py")

NUM_STEPS = 12


@pytest.fixture(scope="module")
def quantized_folders(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("w8a8-stack")
    calibration = folder / "calibration.txt"
    calibration.write_text("\n".join(tiny_corpus()))
    source = tiny_model_dir("llama")
    return {"dynamic": _quantize(source, str(folder / "dynamic")),
            "static": _quantize(source, str(folder / "static"), "--static", "--calibration", str(calibration))}


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_prompts", [1, 5])
def test_stack_steps_bitwise_equal_the_modules(quantized_folders, monkeypatch, scheme: str, dtype: str,
                                               num_prompts: int) -> None:
    import pagedserve.models.native_decode_stack as stack_module

    prompts = random_prompts(num_prompts, 4, 30, seed=num_prompts)
    results = []
    for one_region_max_rows, enabled in ((stack_module.ONE_REGION_MAX_ROWS, True), (0, True), (0, False)):
        monkeypatch.setattr(stack_module, "ONE_REGION_MAX_ROWS", one_region_max_rows)
        llm = LLM(quantized_folders[scheme], dtype=dtype, max_model_len=256, num_kv_blocks=96,
                  native_decode_stack=enabled)
        # logprobs: every step returns the hidden states (greedy_rows stays off)
        results.append(greedy_outputs_with_logprobs(llm, prompts, NUM_STEPS, logprobs=5))
        forward = model_runner_forward(llm)
        if enabled:
            assert isinstance(forward, NativeDecodeForward)
            assert forward.plan.linear_kind == W8A8_KIND and forward.num_stack_steps == NUM_STEPS - 1
            assert forward.plan.native.num_one_region_steps() == (NUM_STEPS - 1 if one_region_max_rows else 0)
        else:
            assert not isinstance(forward, NativeDecodeForward)
    assert results[0] == results[1] == results[2]


# The unquantized LM head samples in the stack in the layouts the stack's region runs: tile-packed bfloat16, plain
# float32 on small_batch_linear (the quantized layers keep their int8 weights whatever the layout).
@pytest.mark.parametrize("dtype,weight_layout", [("float32", "plain_native"), ("bfloat16", "amx_packed")])
def test_greedy_steps_sample_in_the_stack(quantized_folders, dtype: str, weight_layout: str) -> None:
    prompts = random_prompts(3, 4, 30, seed=9)
    llm = LLM(quantized_folders["dynamic"], dtype=dtype, max_model_len=256, num_kv_blocks=96,
              weight_layout=weight_layout)
    forward = model_runner_forward(llm)
    assert forward.plan.greedy_head is not None
    greedy = greedy_outputs_with_logprobs(llm, prompts, NUM_STEPS)
    assert forward.num_greedy_steps == NUM_STEPS - 1
    without_stack = LLM(quantized_folders["dynamic"], dtype=dtype, max_model_len=256, num_kv_blocks=96,
                        native_decode_stack=False)
    assert greedy == greedy_outputs_with_logprobs(without_stack, prompts, NUM_STEPS)


def test_plan_object_checks_the_scales(quantized_folders) -> None:
    llm = LLM(quantized_folders["dynamic"], dtype="float32", max_model_len=256, num_kv_blocks=96)
    greedy_outputs_with_logprobs(llm, [[5, 6, 7]], NUM_STEPS)  # the native plan is made at the first decode step
    plan = model_runner_forward(llm).plan
    with pytest.raises(RuntimeError, match="weight scales and input scales expected"):
        plan.native.set_w8a8_scales([plan.weight_scales[0]], [None])
    wrong = [scale[:, :-1].contiguous() for scale in plan.weight_scales]
    with pytest.raises(RuntimeError, match="layer 0 linear 0 needs"):
        plan.native.set_w8a8_scales(wrong, list(plan.input_scales))
