"""The native decode stack (models/native_decode_stack.py): decode-only steps in one native call.

- On/off equivalence: engines with native_decode_stack=True and False produce bitwise-equal logprobs and the
  same tokens over 40 greedy steps, for every linear method it drives (plain, plain_native, amx_packed,
  prepacked), with
  biases (Qwen2), sliding windows (Mistral, Qwen2 per-layer windows) and batches that cross the small-batch
  linear's 16-row limit.
- The independent oracle: HF transformers' greedy tokens over 32 steps with the stack taking the decode steps.
- Which steps and models take it: forward hooks send steps to the modules, weight swaps make the plan again (or
  end the stack), the option's validation and the op's own argument checks.
"""
from __future__ import annotations

import pytest
import torch

from generation_helpers import random_prompts
from hf_reference import hf_greedy_with_logprobs
from pagedserve import LLM, SamplingParams
from pagedserve.kernels.cpu_library import is_native_extension_available
from pagedserve.config.engine import EngineConfig
from pagedserve.layers.small_batch_linear import small_batch_linear_available
from pagedserve.layers.weight_layout import can_prepack_on_cpu
from pagedserve.models.native_decode_stack import NativeDecodeForward, native_decode_stack_plan

pytestmark = pytest.mark.skipif(not is_native_extension_available(),
                                reason="the native CPU kernels do not build here (no compiler)")

NUM_STEPS = 40
# oneDNN packs bf16 weights only with AVX-512 (or AVX-NE-CONVERT): on an AVX2 CPU the prepacked layout the stack
# drives is float32's.
PREPACK_DTYPE = next((dtype for dtype in ("bfloat16", "float32") if can_prepack_on_cpu(getattr(torch, dtype))), "")
NEEDS_PREPACK = pytest.mark.skipif(PREPACK_DTYPE == "", reason="oneDNN packs neither bf16 nor fp32 weights here")


def _skip_without_prepack(dtype: str) -> None:
    """'prepacked' needs a oneDNN GEMM of the dtype on this CPU (none in bfloat16 on an AVX2-only CPU)."""
    if not can_prepack_on_cpu(getattr(torch, dtype)):
        pytest.skip(f"oneDNN runs no {dtype} GEMM on this CPU: weight_layout='prepacked' is not available")


def _llm(folder: str, **options) -> LLM:
    options.setdefault("num_kv_blocks", 64)
    return LLM(folder, max_model_len=256, **options)


def _forward(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner.forward


def _model(llm: LLM) -> torch.nn.Module:
    return llm.llm_engine.engine_core.executor.worker.model_runner.model


def _generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [sorted((token, entry.logprob) for token, entry in step.items()) for step in o.outputs[0].logprobs])
            for o in outputs]


CASES = [
    # (kind, dtype, weight_layout, number of prompts)
    ("llama", "float32", "plain", 3),
    ("llama", "float32", "plain_native", 3),
    ("llama", "float32", "plain_native", 19),  # above the small-batch linear's 16 rows: F.linear inside the stack
    ("llama-tied", "bfloat16", "plain", 4),
    ("qwen2", "float32", "auto", 5),  # q/k/v biases
    ("qwen2-sliding", "float32", "auto", 3),  # a full layer, then a 16-token window
    ("mistral", "bfloat16", "auto", 3),  # 16-token window on every layer; amx_packed (a unit in every build)
    pytest.param("llama", PREPACK_DTYPE, "prepacked", 3, marks=NEEDS_PREPACK),  # oneDNN's packed GEMM
]


@pytest.mark.parametrize("kind,dtype,weight_layout,num_prompts", CASES)
def test_on_off_bitwise_equal(tiny_model_dir, kind: str, dtype: str, weight_layout: str, num_prompts: int) -> None:
    if weight_layout == "prepacked":
        _skip_without_prepack(dtype)
    folder = tiny_model_dir(kind)
    prompts = random_prompts(num_prompts, 5, 40, seed=num_prompts)
    results = []
    for enabled in (True, False):
        llm = _llm(folder, dtype=dtype, weight_layout=weight_layout, num_kv_blocks=64 + 8 * num_prompts,
                  native_decode_stack=enabled)
        results.append(_generate(llm, prompts))
        forward = _forward(llm)
        if enabled:
            assert isinstance(forward, NativeDecodeForward), native_decode_stack_plan(_model(llm), getattr(
                torch, dtype)).reason
            # Every step after the first (the prompts' prefill) is decode-only.
            assert forward.num_stack_steps == NUM_STEPS - 1
        else:
            assert not isinstance(forward, NativeDecodeForward)
    assert results[0] == results[1]


def test_amx_packed_layout_takes_the_stack(tiny_model_dir) -> None:
    llm = _llm(tiny_model_dir("llama"), dtype="bfloat16", weight_layout="amx_packed")
    prompts = random_prompts(3, 5, 40, seed=7)
    with_stack = _generate(llm, prompts)
    assert _forward(llm).plan.linear_kind == 2
    without = _generate(_llm(tiny_model_dir("llama"), dtype="bfloat16", weight_layout="amx_packed",
                            native_decode_stack=False), prompts)
    assert with_stack == without


@pytest.mark.parametrize("is_intel", [True, False], ids=["mkl-above-16", "onednn-above-16"])
def test_plain_native_large_batches_follow_the_vendor(tiny_model_dir, monkeypatch, is_intel: bool) -> None:
    """Float32 plain_native above 16 rows: F.linear on Intel (kind 1), oneDNN on the plain weight elsewhere (kind 4);
    19 requests decode above the limit, bitwise the same with and without the stack."""
    import pagedserve.layers.small_batch_linear as small_batch_module

    monkeypatch.setattr(small_batch_module, "is_intel_cpu", lambda: is_intel)
    folder = tiny_model_dir("llama")
    prompts = random_prompts(19, 5, 40, seed=19)
    results = []
    for enabled in (True, False):
        llm = _llm(folder, dtype="float32", weight_layout="plain_native", num_kv_blocks=64 + 8 * 19,
                  native_decode_stack=enabled)
        results.append(_generate(llm, prompts))
        if enabled:
            assert _forward(llm).plan.linear_kind == (1 if is_intel else 4)
    assert results[0] == results[1]


@NEEDS_PREPACK
def test_prepacked_layout_takes_the_stack(tiny_model_dir) -> None:
    llm = _llm(tiny_model_dir("llama"), dtype=PREPACK_DTYPE, weight_layout="prepacked")
    _generate(llm, random_prompts(2, 5, 40, seed=8))
    assert _forward(llm).plan.linear_kind == 3
    assert _forward(llm).num_stack_steps == NUM_STEPS - 1


def test_greedy_matches_hf(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    prompts = random_prompts(3, 8, 30, seed=3)
    llm = _llm(folder, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert _forward(llm).num_stack_steps == 31
    expected = hf_greedy_with_logprobs(folder, prompts, 32, 1)
    assert [o.outputs[0].token_ids for o in outputs] == [tokens for tokens, _ in expected]


def test_mixed_steps_take_the_modules(tiny_model_dir) -> None:
    """A step holding a prefill (or a chunk of one) runs on the modules; only decode-only steps take the stack."""
    llm = _llm(tiny_model_dir("llama"), dtype="float32", max_num_batched_tokens=16)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": list(range(10, 20))}, params)
    engine.step()  # a's prefill
    engine.add_request("b", {"prompt_token_ids": list(range(10, 50))}, params)  # 40 tokens: three chunks
    forward = _forward(llm)
    for _ in range(3):
        engine.step()  # a decodes next to b's chunks
    assert forward.num_stack_steps == 0
    while engine.has_unfinished_requests():
        engine.step()
    assert forward.num_stack_steps > 0


def test_forward_hooks_fire(tiny_model_dir) -> None:
    """While a hook is registered the decode steps take the modules, so it sees every forward; removed, the
    stack takes them again. The outputs are the same throughout (no prefix cache: every run computes its prompts)."""
    llm = _llm(tiny_model_dir("llama"), dtype="float32", enable_prefix_caching=False)
    forward, model = _forward(llm), _model(llm)
    prompts = random_prompts(2, 5, 20, seed=11)
    reference = _generate(llm, prompts)
    steps_before = forward.num_stack_steps
    assert steps_before > 0
    seen: list[int] = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[0]))
    with_hook = _generate(llm, prompts)
    handle.remove()
    assert forward.num_stack_steps == steps_before
    assert len(seen) == 1 + (NUM_STEPS - 1)  # the two prompts' prefill step, then every decode step
    pre_handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    try:
        _generate(llm, prompts[:1])
        assert forward.num_stack_steps == steps_before  # a global hook keeps the modules too
    finally:
        pre_handle.remove()
    assert _generate(llm, prompts) == with_hook == reference
    assert forward.num_stack_steps == 2 * steps_before


def test_weight_swap_makes_the_plan_again(tiny_model_dir) -> None:
    """restore_plain_layout replaces every packed weight by its plain form and the linear method: the next decode
    step sees it, makes its plan again (plain linears) and keeps producing the same tokens."""
    from pagedserve.layers.weight_layout import restore_plain_layout

    folder = tiny_model_dir("llama")
    llm = _llm(folder, dtype="bfloat16", weight_layout="amx_packed", enable_prefix_caching=False)
    forward = _forward(llm)
    prompts = random_prompts(2, 5, 20, seed=5)
    packed_tokens = [tokens for tokens, _ in _generate(llm, prompts)]
    assert forward.plan.linear_kind == 2
    assert restore_plain_layout(_model(llm)) > 0
    steps_before = forward.num_stack_steps
    plain_outputs = _generate(llm, prompts)
    assert forward.plan.linear_kind == 0 and forward.num_stack_steps > steps_before
    fresh = _generate(_llm(folder, dtype="bfloat16", weight_layout="plain", native_decode_stack=False), prompts)
    assert plain_outputs == fresh
    assert len(packed_tokens) == len(plain_outputs)


def test_model_that_stops_qualifying_keeps_the_modules(tiny_model_dir) -> None:
    """A swap that leaves no native form (a linear method the stack does not drive) ends the stack for good."""
    llm = _llm(tiny_model_dir("llama"), dtype="float32", enable_prefix_caching=False)
    forward, model = _forward(llm), _model(llm)
    prompts = random_prompts(1, 5, 10, seed=2)
    reference = _generate(llm, prompts)
    down_proj = model.model.layers[0].mlp.down_proj
    # The same computation under a method class the stack has no native form for.
    down_proj.linear_method = type("UnknownLinearMethod", (type(down_proj.linear_method),), {})()
    steps_before = forward.num_stack_steps
    assert _generate(llm, prompts) == reference
    assert forward.plan is None and forward.num_stack_steps == steps_before


def test_assigned_weight_makes_the_plan_again(tiny_model_dir, caplog) -> None:
    """A parameter assigned through the module (a new tensor, not an in-place change) advances the watched-attribute
    epoch: the next decode step compares the plan's sources, makes the plan again (logged) and computes with the
    new weight, as the modules do. The plan made again at the first step, because the KV caches were bound after
    planning, is not logged at INFO."""
    import logging

    from torch import nn

    folder = tiny_model_dir("llama")
    llm, reference = (_llm(folder, dtype="float32", enable_prefix_caching=False, native_decode_stack=on)
                      for on in (True, False))
    forward = _forward(llm)
    prompts = random_prompts(2, 5, 20, seed=7)
    with caplog.at_level(logging.INFO, logger="pagedserve.models.native_decode_stack"):
        before = _generate(llm, prompts)
    assert "plan made again" not in caplog.text
    old_plan = forward.plan
    for engine in (llm, reference):
        down_proj = _model(engine).model.layers[1].mlp.down_proj
        down_proj.weight = nn.Parameter(down_proj.weight * 0.5, requires_grad=False)
    steps_before = forward.num_stack_steps
    with caplog.at_level(logging.INFO, logger="pagedserve.models.native_decode_stack"):
        after = _generate(llm, prompts)
    assert "plan made again" in caplog.text
    assert forward.plan is not old_plan and forward.num_stack_steps > steps_before
    assert after == _generate(reference, prompts)
    assert after != before


def test_plan_is_compared_only_when_the_epoch_moves(tiny_model_dir) -> None:
    """Steady decode steps compare one integer, not the plan's ~550 sources: a weight written straight into a
    module's _parameters (past nn.Module's API, so not counted) goes unseen, until any watched assignment moves the
    epoch; then the next step compares the sources, finds the change and makes the plan again."""
    from torch import nn

    from pagedserve.layers.norm import RMSNorm
    from pagedserve.layers.watched_attributes import watched_attributes_epoch

    llm = _llm(tiny_model_dir("llama"), dtype="float32", enable_prefix_caching=False)
    forward = _forward(llm)
    prompts = random_prompts(1, 5, 10, seed=3)
    _generate(llm, prompts)
    plan = forward.plan
    assert plan.epoch == watched_attributes_epoch()  # decode steps assign no watched attribute
    down_proj = _model(llm).model.layers[0].mlp.down_proj
    down_proj._parameters["weight"] = nn.Parameter(down_proj.weight.clone(), requires_grad=False)
    _generate(llm, prompts)
    assert forward.plan is plan
    RMSNorm(4).weight = nn.Parameter(torch.ones(4))  # an unrelated layer: the epoch moves
    _generate(llm, prompts)
    assert forward.plan is not plan and forward.plan.weights[5] is down_proj.weight


def test_positions_beyond_the_rotary_table_raise_value_error(tiny_model_dir, caplog) -> None:
    """The stack checks positions as the modules do: a decode step past the rotary table fails with the modules'
    ValueError (the engine fails that step's requests and logs it)."""
    import logging

    llm = _llm(tiny_model_dir("llama"), dtype="float32")
    rotary = _model(llm).model.rotary_emb
    rotary.max_positions = 12  # the check's limit; the table itself stays whole
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with caplog.at_level(logging.ERROR):
        llm.generate([{"prompt_token_ids": list(range(5))}], params, use_tqdm=False)
    assert _forward(llm).num_stack_steps == 7  # positions 5..11 decoded on the stack, then 12 fails
    assert "ValueError: position 12 is beyond the rotary table (max_positions=12)" in caplog.text


@pytest.mark.parametrize("kind,options,reason", [
    ("qwen3", {}, "not a plain Llama layer"),  # q/k RMSNorm before RoPE
    ("llama", {"attention_backend": "torch_paged"}, "attention backend torch_paged"),
])
def test_models_that_keep_the_modules(tiny_model_dir, kind: str, options: dict, reason: str) -> None:
    llm = _llm(tiny_model_dir(kind), dtype="float32", **options)
    assert not isinstance(_forward(llm), NativeDecodeForward)
    assert reason in native_decode_stack_plan(_model(llm), torch.float32).reason


def test_batch_invariant_keeps_the_modules(tiny_model_dir) -> None:
    llm = _llm(tiny_model_dir("llama"), dtype="float32", batch_invariant=True)
    assert not isinstance(_forward(llm), NativeDecodeForward)


def test_option_is_validated_and_parsed(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match=r"native_decode_stack='yes' must be true or false"):
        EngineConfig.create(tiny_model_dir("llama"), native_decode_stack="yes")
    from pagedserve.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", tiny_model_dir("llama"), "--no-native-decode-stack"])
    from pagedserve.config.cli_args import engine_kwargs_from_args

    assert engine_kwargs_from_args(args)["native_decode_stack"] is False


def test_plan_object_rejects_mismatched_lists(tiny_model_dir) -> None:
    llm = _llm(tiny_model_dir("llama"), dtype="float32")
    plan = _forward(llm).plan
    kv_caches = [layer.kv_cache for layer in plan.attention_layers]
    make = torch.classes.pagedserve.DecodeStackPlan
    arguments = [plan.embedding, plan.final_norm, plan.cos_sin_cache, list(plan.output_sizes),
                 list(plan.sliding_windows), plan.num_heads, plan.num_kv_heads, plan.head_dim, plan.eps, plan.scale,
                 plan.linear_kind, 8, 256, 4]
    with pytest.raises(RuntimeError, match=r"12 weights expected for 2 layers, got 11"):
        make(list(plan.weights[:-1]), list(plan.biases), kv_caches, *arguments)
    arguments[10] = 7
    with pytest.raises(RuntimeError, match=r"linear_kind=7 must be 0, 1, 2, 3, 4, 5 or 6"):
        make(list(plan.weights), list(plan.biases), kv_caches, *arguments)


def test_rebound_kv_caches_make_the_plan_again(tiny_model_dir) -> None:
    """The native plan object holds the layers' KV caches: binding new ones (an attribute the layers watch) makes
    the plan again at the next step, which then reads and writes the new caches."""
    llm = _llm(tiny_model_dir("llama"), dtype="float32", enable_prefix_caching=False)
    forward = _forward(llm)
    prompts = random_prompts(2, 5, 20, seed=11)
    reference = _generate(llm, prompts)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    old_plan = forward.plan
    new_caches = [torch.zeros_like(layer.kv_cache) for layer in old_plan.attention_layers]
    runner.bind_kv_caches(new_caches)
    assert _generate(llm, prompts) == reference
    assert forward.plan is not old_plan and forward.plan.native is not None
    assert all(cache.abs().sum() > 0 for cache in new_caches)  # the stack and the modules wrote the new caches


REGION_LAYOUTS = [
    # (dtype, weight_layout, linear_kind): the kinds whose steps run in one region
    pytest.param("bfloat16", "amx_packed", 2),  # every native build has a unit of amx_packed
    pytest.param("float32", "plain_native", None, marks=pytest.mark.skipif(
        not small_batch_linear_available(),
        reason="needs the small-batch float32 kernel (built at the avx2 level and above)")),
]


@pytest.mark.parametrize("dtype,weight_layout,linear_kind", REGION_LAYOUTS)
@pytest.mark.parametrize("num_prompts", [1, 2, 5])
def test_one_region_equals_op_by_op_and_the_modules(tiny_model_dir, monkeypatch, num_prompts: int, dtype: str,
                                                     weight_layout: str, linear_kind: int | None) -> None:
    """Steps of up to ONE_REGION_MAX_ROWS rows on tile-packed bfloat16 or small-batch float32 weights run the layers
    in one parallel region; their tokens and logprobs are bitwise those of the same stack op by op
    (ONE_REGION_MAX_ROWS = 0) and of the modules, with one row (thread 1 has no row of its own) and more. The
    prompts reach past the 256-token attention partition during decode, so the region also merges partitions."""
    import pagedserve.models.native_decode_stack as stack_module

    folder = tiny_model_dir("llama")
    prompts = random_prompts(num_prompts, 230, 250, seed=num_prompts)
    options = dict(dtype=dtype, weight_layout=weight_layout, max_model_len=512, num_kv_blocks=40 * num_prompts)
    results = []
    for one_region_max_rows, enabled in ((stack_module.ONE_REGION_MAX_ROWS, True), (0, True), (0, False)):
        monkeypatch.setattr(stack_module, "ONE_REGION_MAX_ROWS", one_region_max_rows)
        llm = LLM(folder, native_decode_stack=enabled, **options)
        results.append(_generate(llm, prompts))
        if enabled:
            forward = _forward(llm)
            assert forward.plan.linear_kind in ((1, 4) if linear_kind is None else (linear_kind,))
            assert forward.num_stack_steps == NUM_STEPS - 1
            in_region = forward.plan.native.num_one_region_steps()
            assert in_region == (NUM_STEPS - 1 if 0 < num_prompts <= one_region_max_rows else 0)
    assert results[0] == results[1] == results[2]


@pytest.mark.parametrize("bad_request", [0, 1])
@pytest.mark.timeout(120, method="thread")  # a thread left at the barrier hangs the call: exit, not wait
def test_one_region_raises_and_leaves_no_thread_waiting(tiny_model_dir, bad_request: int) -> None:
    """An error inside the region is raised to the caller and the next call runs normally: a block id beyond the
    cache in one of two requests (with two threads, one thread attends each request's items and raises while the
    other waits at the barrier). A slot beyond the cache is refused before the region starts."""
    llm = _llm(tiny_model_dir("llama"), dtype="bfloat16", weight_layout="amx_packed")
    reference = _generate(llm, [[5, 6, 7, 8]])
    forward = _forward(llm)
    native = forward.plan.native
    num_blocks = forward.plan.attention_layers[0].kv_cache.shape[1]
    input_ids = torch.tensor([11, 12], dtype=torch.long)
    positions = torch.tensor([4, 4], dtype=torch.long)
    seq_lens = torch.tensor([5, 5], dtype=torch.int32)
    slot_mapping = torch.tensor([4, 20], dtype=torch.long)
    bad_table = torch.tensor([[0, 2], [1, 3]], dtype=torch.int32)
    bad_table[bad_request, 0] = num_blocks + 3
    steps_before = native.num_one_region_steps()
    with pytest.raises(RuntimeError, match=rf"block id {num_blocks + 3} out of range"):
        forward.op(native, input_ids, positions, bad_table, seq_lens, slot_mapping, 256)
    assert native.num_one_region_steps() == steps_before + 1
    good_table = torch.tensor([[0, 2], [1, 3]], dtype=torch.int32)
    bad_slots = torch.tensor([4, num_blocks * 16 + 1], dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[1\]=.* is out of range"):
        forward.op(native, input_ids, positions, good_table, seq_lens, bad_slots, 256)
    assert _generate(llm, [[5, 6, 7, 8]]) == reference


def _greedy_tokens(llm: LLM, prompts: list[list[int]], **params) -> list[list[int]]:
    sampling = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True, **params)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sampling,
                                                         use_tqdm=False)]


@pytest.mark.parametrize("dtype,weight_layout,linear_kind", REGION_LAYOUTS)
@pytest.mark.parametrize("in_region", [True, False], ids=["one-region", "op-by-op"])
@pytest.mark.parametrize("num_prompts", [1, 2, 5])
def test_greedy_steps_sample_in_the_stack(tiny_model_dir, monkeypatch, num_prompts: int, in_region: bool, dtype: str,
                                          weight_layout: str, linear_kind: int | None) -> None:
    """Steps whose requests only sample greedily take greedy_rows: the batch's inputs, the stack, the LM head's
    argmax and the append in one call (bfloat16: in the region, or after the layers op by op; float32: in the region
    only, else the general path). The tokens equal those of the stack with the head sampled separately and of the
    modules. Prompts reach past the first 128-token partition (DECODE_PARTITION_TOKENS)."""
    import pagedserve.models.native_decode_stack as stack_module

    if not in_region:
        monkeypatch.setattr(stack_module, "ONE_REGION_MAX_ROWS", 0)
    folder = tiny_model_dir("llama")
    prompts = random_prompts(num_prompts, 230, 250, seed=num_prompts)
    options = dict(dtype=dtype, weight_layout=weight_layout, max_model_len=512, num_kv_blocks=40 * num_prompts)
    llm = LLM(folder, **options)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    forward = _forward(llm)
    assert forward.plan.greedy_head is not None and runner.greedy_decode is not None
    greedy = _greedy_tokens(llm, prompts)
    is_sampled_in_stack = in_region or dtype == "bfloat16"
    assert forward.num_stack_steps == NUM_STEPS - 1
    assert forward.num_greedy_steps == (NUM_STEPS - 1 if is_sampled_in_stack else 0)
    assert forward.plan.native.num_one_region_steps() == (NUM_STEPS - 1 if in_region else 0)
    runner.greedy_decode = None  # the stack's hidden states, then the sampler (FusedGreedySampler in bfloat16)
    separate = _greedy_tokens(llm, prompts)
    assert forward.num_stack_steps == 2 * (NUM_STEPS - 1)
    assert forward.num_greedy_steps == (NUM_STEPS - 1 if is_sampled_in_stack else 0)
    modules = _greedy_tokens(LLM(folder, native_decode_stack=False, **options), prompts)
    assert greedy == separate == modules


@pytest.mark.parametrize("params", [dict(logprobs=1), dict(presence_penalty=0.5),
                                    dict(min_tokens=NUM_STEPS, stop_token_ids=[7])],
                         ids=["logprobs", "penalty", "min-tokens"])
def test_steps_that_need_more_than_the_argmax_take_the_sampler(tiny_model_dir, params: dict) -> None:
    """One request asking for more than the greedy token (logprobs, a penalty, min_tokens) sends every step it is
    in through the stack's hidden states and the sampler; the tokens are those of the modules."""
    folder = tiny_model_dir("llama")
    llm = _llm(folder, dtype="bfloat16", weight_layout="amx_packed")
    prompts = random_prompts(2, 5, 40, seed=21)
    sampling = [SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True),
                SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True, **params)]

    def tokens(engine_llm: LLM) -> list[list[int]]:
        outputs = engine_llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]

    with_stack = tokens(llm)
    forward = _forward(llm)
    assert forward.num_stack_steps == NUM_STEPS - 1 and forward.num_greedy_steps == 0
    assert with_stack == tokens(_llm(folder, dtype="bfloat16", weight_layout="amx_packed", native_decode_stack=False))


def test_greedy_head_only_beside_native_layers(tiny_model_dir) -> None:
    """Plain float32 layers (F.linear) keep no head: their greedy steps take the general path, and the op refuses a
    plan without a batch or a head."""
    llm = _llm(tiny_model_dir("llama"), dtype="float32", weight_layout="plain")
    _greedy_tokens(llm, [[5, 6, 7, 8]])
    forward = _forward(llm)
    assert forward.plan.greedy_head is None and forward.num_greedy_steps == 0 and forward.num_stack_steps > 0
    assert forward.greedy_rows([0]) is None
    native = forward.plan.native
    assert not native.has_greedy_head()
    with pytest.raises(RuntimeError, match=r"no batch bound \(DecodeStackPlan.bind_batch\)"):
        forward.decode_rows_greedy(native.handle(), [0], 256)
    native.bind_batch(*forward.batch_arrays)
    with pytest.raises(RuntimeError, match="the plan has no LM head"):
        forward.decode_rows_greedy(native.handle(), [0], 256)
    with pytest.raises(RuntimeError, match="no live DecodeStackPlan has handle -1"):
        forward.decode_rows_greedy(-1, [0], 256)


def test_greedy_rows_checks_the_batch(tiny_model_dir) -> None:
    """The step reads the runner's batch: a row outside it, or one without the blocks its position needs, is refused
    with the row named, and a row whose next token is not sampled (a one-token prefill chunk) gives an empty result
    with the batch untouched."""
    llm = _llm(tiny_model_dir("llama"), dtype="bfloat16", weight_layout="amx_packed")
    reference = _greedy_tokens(llm, [[5, 6, 7, 8]])
    forward = _forward(llm)
    handle = forward.plan.handle
    token_ids, num_tokens, num_computed, block_table, num_blocks = (array.numpy() for array in forward.batch_arrays)
    with pytest.raises(RuntimeError, match=r"rows\[0\]=.* is outside the batch's"):
        forward.decode_rows_greedy(handle, [len(num_tokens)], 256)
    row = 3
    token_ids[row, :4] = [5, 6, 7, 8]
    num_tokens[row], num_computed[row], num_blocks[row] = 4, 2, 1  # position 2 is not the last: not sampled
    before = token_ids.copy()
    assert forward.decode_rows_greedy(handle, [row], 256) == []
    assert (token_ids == before).all() and num_tokens[row] == 4
    num_computed[row], num_blocks[row] = 3, 0
    with pytest.raises(RuntimeError, match=rf"row {row} has 0 blocks; position 3 needs 1"):
        forward.decode_rows_greedy(handle, [row], 256)
    num_tokens[row] = num_computed[row] = num_blocks[row] = 0
    assert _greedy_tokens(llm, [[5, 6, 7, 8]]) == reference
