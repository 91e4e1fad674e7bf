"""The native decode stack on GGUF blocks kept quantized (linear kind 5, models/native_decode_stack.py): decode steps
bitwise equal to the modules' (layers/gguf_linear.py) in one region, op by op and past the vector products' 8 rows,
with the greedy head sampling in the stack; the modules themselves are checked against transformers in
test_gguf_kept_quantized.py."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from native_marks import NEEDS_GGUF_KERNELS
from generation_helpers import count_stack_verifications, greedy_outputs_with_logprobs, model_runner_forward

from pagedserve import LLM
from pagedserve.layers.gguf_linear import gguf_linear_products
from pagedserve.models.native_decode_stack import GGUF_KIND, NativeDecodeForward, native_decode_stack_plan
from test_gguf_tiny_files import write_tiny_gguf

pytestmark = NEEDS_GGUF_KERNELS

NUM_STEPS = 24


def random_prompts(num: int, low: int, high: int, seed: int) -> list[list[int]]:
    """`num` prompts of random ids inside the tiny files' 268-token vocabulary."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 268) for _ in range(rng.randint(low, high))] for _ in range(num)]


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("gguf-stack")
    files = {}
    for name, architecture, ggml_type, with_output in (
            ("llama-q4_1-tied", "llama", GGMLQuantizationType.Q4_1, False),
            ("qwen2-q8_0", "qwen2", GGMLQuantizationType.Q8_0, True)):  # q/k/v biases, a Q8_0 head of its own
        files[name] = str(folder / f"{name}.gguf")
        write_tiny_gguf(files[name], architecture, ggml_type, with_output=with_output, seed=7,
                        norm_weights_near_one=True)
    # Fused linears whose parts mix types (GGUFPartsLinearMethod): layer 0's qkv (biased) with a Q8_0 v, layer 1's
    # gate_up with a Q5_0 up (a type the amx unit does not take).
    files["qwen2-mixed"] = str(folder / "qwen2-mixed.gguf")
    write_tiny_gguf(files["qwen2-mixed"], "qwen2", GGMLQuantizationType.Q4_1, seed=7, norm_weights_near_one=True,
                    tensor_types={"blk.0.attn_v.weight": GGMLQuantizationType.Q8_0,
                                  "blk.1.ffn_up.weight": GGMLQuantizationType.Q5_0})
    return files


def _llm(path: str, **options) -> LLM:
    return LLM(path, dtype="float32", max_model_len=256, num_kv_blocks=160, **options)


@pytest.mark.parametrize("name", ["llama-q4_1-tied", "qwen2-q8_0", "qwen2-mixed"])
@pytest.mark.parametrize("num_prompts", [1, 3, 10, 40])  # 10, 40 rows: past the vector unit's 8 (amx or dequantized)
def test_stack_steps_bitwise_equal_the_modules(gguf_files, monkeypatch, name: str, num_prompts: int) -> None:
    import pagedserve.models.native_decode_stack as stack_module

    # Steps past 8 rows stay in one region where the kernel's amx unit takes every type of the file (Q4_1, Q8_0: not
    # the mixed file's Q5_0); else they run op by op on dequantized tiles.
    kernel_rows = 256 if "amx" in gguf_linear_products() and name != "qwen2-mixed" else 8

    prompts = random_prompts(num_prompts, 4, 30, seed=num_prompts)
    results = []
    for one_region_max_rows, enabled in ((stack_module.ONE_REGION_MAX_ROWS, True), (0, True), (0, False)):
        monkeypatch.setattr(stack_module, "ONE_REGION_MAX_ROWS", one_region_max_rows)
        llm = _llm(gguf_files[name], native_decode_stack=enabled)
        results.append(greedy_outputs_with_logprobs(llm, prompts, NUM_STEPS, logprobs=5))
        forward = model_runner_forward(llm)
        if enabled:
            assert isinstance(forward, NativeDecodeForward)
            assert forward.plan.linear_kind == GGUF_KIND and forward.num_stack_steps == NUM_STEPS - 1
            assert len(forward.plan.weight_parts) == (8 if name == "qwen2-mixed" else 0)
            in_region = forward.plan.native.num_one_region_steps()
            assert in_region == (NUM_STEPS - 1 if num_prompts <= min(kernel_rows, one_region_max_rows) else 0)
        else:
            assert not isinstance(forward, NativeDecodeForward)
    assert results[0] == results[1] == results[2]


@pytest.mark.parametrize("name", ["llama-q4_1-tied", "qwen2-q8_0"])
def test_greedy_steps_sample_on_the_quantized_head_in_the_stack(gguf_files, name: str) -> None:
    prompts = random_prompts(3, 4, 30, seed=5)
    llm = _llm(gguf_files[name])
    forward = model_runner_forward(llm)
    assert forward.plan.greedy_head is not None and forward.plan.head_type != 0
    greedy = greedy_outputs_with_logprobs(llm, prompts, NUM_STEPS)
    assert forward.num_greedy_steps == NUM_STEPS - 1
    assert greedy == greedy_outputs_with_logprobs(_llm(gguf_files[name], native_decode_stack=False), prompts,
                                                  NUM_STEPS)


@pytest.mark.parametrize("name", ["llama-q4_1-tied", "qwen2-q8_0"])
def test_greedy_verification_on_the_quantized_head_in_the_stack(gguf_files, monkeypatch, name: str) -> None:
    """ngram drafts verified on the stack (layers and head in one call, K + 1 rows per request) give the tokens of
    the modules' verification and of plain decoding."""
    base = random_prompts(3, 4, 10, seed=9)
    prompts = [p + p + p[:2] for p in base]  # prompt lookup finds drafts
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = _llm(gguf_files[name], speculative_config=config)
    taken = count_stack_verifications(llm, monkeypatch)
    speculative = greedy_outputs_with_logprobs(llm, prompts, NUM_STEPS)
    assert taken and max(taken) > len(prompts)  # steps with drafts: more rows than requests
    modules = _llm(gguf_files[name], native_decode_stack=False, speculative_config=config)
    assert speculative == greedy_outputs_with_logprobs(modules, prompts, NUM_STEPS) \
        == greedy_outputs_with_logprobs(_llm(gguf_files[name], native_decode_stack=False), prompts, NUM_STEPS)


def test_bfloat16_gguf_model_keeps_the_modules(gguf_files) -> None:
    llm = LLM(gguf_files["llama-q4_1-tied"], dtype="bfloat16", max_model_len=256, num_kv_blocks=64)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    assert "bfloat16" in native_decode_stack_plan(model, torch.bfloat16).reason
    assert not isinstance(model_runner_forward(llm), NativeDecodeForward)


def test_plan_object_checks_the_block_types(gguf_files) -> None:
    llm = _llm(gguf_files["llama-q4_1-tied"])
    greedy_outputs_with_logprobs(llm, [[5, 6, 7]], NUM_STEPS)  # the native plan is made at the first decode step
    forward = model_runner_forward(llm)
    native = forward.plan.native
    with pytest.raises(RuntimeError, match="linear types expected"):
        native.set_gguf_types([3], 8, 8)
    with pytest.raises(RuntimeError, match="has no kernel"):
        native.set_gguf_types([1] * len(forward.plan.weight_types), 3, 3)


def test_plan_object_checks_the_gguf_parts(gguf_files) -> None:
    llm = _llm(gguf_files["qwen2-mixed"])
    greedy_outputs_with_logprobs(llm, [[5, 6, 7]], NUM_STEPS)
    forward = model_runner_forward(llm)
    native, tables = forward.plan.native, list(forward.plan.weight_parts)
    assert [len(table) for table in tables] == [3, 0, 0, 0, 0, 0, 2, 0]  # layer 0's qkv, layer 1's gate_up
    with pytest.raises(RuntimeError, match="part tables expected"):
        native.set_gguf_parts(tables[:4])
    shifted = tables[0].clone()
    shifted[1, 2] += 1  # k's bytes no longer follow q's
    with pytest.raises(RuntimeError, match="linear 0 part 1 does not follow the one before it"):
        native.set_gguf_parts([shifted, *tables[1:]])
    short = tables[0][:2]  # q and k only: the columns and bytes are not filled
    with pytest.raises(RuntimeError, match="linear 0's parts do not fill its"):
        native.set_gguf_parts([short, *tables[1:]])
