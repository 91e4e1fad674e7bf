"""W8A8 checkpoints written by `pagedserve quantize` from tiny random models of every dense family load with no
flag and generate, greedily over 32 tokens, what a plain-PyTorch dequantize-then-run reference generates (HF
transformers in float32, tests/quantization/w8a8_reference.py); their logprobs stay within LOGPROB_TOLERANCE of the
unquantized model's; TP=2 equals one process."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.cli import main as cli_main
from tiny_models import tiny_corpus
from w8a8_reference import dequantized_hf_model, greedy_with_logprobs, teacher_forced_logprobs

NUM_TOKENS = 32
PROMPTS = [[5, 17, 99, 23, 41, 8], [300, 12, 7, 250, 61, 33, 90, 101, 14, 2, 77, 45, 19, 200, 5, 66, 31]]
# Largest |logprob(W8A8) - logprob(float)| of a chosen token, the unquantized model teacher-forced on the W8A8
# model's tokens. Per-channel int8 weights and per-token int8 activations of these tiny random models move a chosen
# token's logprob by little: measured 0.018-0.039 over the four families (dynamic) and 0.054 (static, Qwen2).
LOGPROB_TOLERANCE = 0.15
# Largest |logprob(engine) - logprob(reference)|: the two compute the same int8 values but not in the same float
# order (int32 accumulators scaled once against float32 dot products of dequantized values), and a last-bit
# difference upstream can move one activation across an int8 rounding boundary (measured up to 0.009, Qwen3).
REFERENCE_LOGPROB_TOLERANCE = 0.03
ENGINE = dict(max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=64)


def _quantize(source: str, out: str, *extra: str) -> str:
    assert cli_main(["quantize", "--model", source, "--out", out, *extra]) == 0
    return out


def _engine_outputs(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        results.append((tokens, [step[token].logprob for step, token in zip(completion.logprobs, tokens)]))
    return results


def _check_against_references(source: str, quantized: str, llm: LLM) -> None:
    engine = _engine_outputs(llm)
    reference = dequantized_hf_model(source, quantized)
    unquantized = AutoModelForCausalLM.from_pretrained(source, local_files_only=True).eval()
    for prompt, (tokens, logprobs) in zip(PROMPTS, engine):
        expected_tokens, expected_logprobs = greedy_with_logprobs(reference, prompt, NUM_TOKENS)
        assert tokens == expected_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs)) < REFERENCE_LOGPROB_TOLERANCE
        float_logprobs = teacher_forced_logprobs(unquantized, prompt, tokens)
        drift = max(abs(a - b) for a, b in zip(logprobs, float_logprobs))
        print(f"max |logprob W8A8 - float| = {drift:.4f}")
        assert drift < LOGPROB_TOLERANCE


# Qwen2 (q/k/v biases) runs in the default suite through the static test; Mistral only adds a sliding window.
@pytest.mark.parametrize("kind", ["llama", "qwen3", pytest.param("qwen2", marks=pytest.mark.slow),
                                  pytest.param("mistral", marks=pytest.mark.slow)])
def test_dynamic_w8a8_equals_dequantized_reference(kind: str, tiny_model_dir, tmp_path) -> None:
    source = tiny_model_dir(kind)
    quantized = _quantize(source, str(tmp_path / "w8a8"))
    llm = LLM(quantized, **ENGINE)
    _check_against_references(source, quantized, llm)


def test_static_w8a8_equals_dequantized_reference(tiny_model_dir, tmp_path) -> None:
    source = tiny_model_dir("qwen2")  # q/k/v biases on top of the static input scales
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("\n".join(tiny_corpus()))
    quantized = _quantize(source, str(tmp_path / "w8a8-static"), "--static", "--calibration", str(calibration))
    llm = LLM(quantized, **ENGINE)
    _check_against_references(source, quantized, llm)


def test_smoothquant_and_ignore_keep_the_checkpoint_format(tiny_model_dir, tmp_path) -> None:
    """--smoothquant-alpha changes the stored norms and weights, --ignore keeps a linear in float: the checkpoint
    still loads with no flag and runs what the dequantized reference (which reads the smoothed norms) runs."""
    source = tiny_model_dir("llama")
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("\n".join(tiny_corpus()))
    kept = "model.layers.1.mlp.down_proj"
    quantized = _quantize(source, str(tmp_path / "w8a8-smoothed"), "--smoothquant-alpha", "0.5", "--calibration",
                          str(calibration), "--ignore", r"re:.*layers\.1\.mlp\.down_proj$")
    with open(os.path.join(quantized, "config.json")) as handle:
        assert kept in json.load(handle)["quantization_config"]["ignore"]
    tensors, original = load_file(f"{quantized}/model.safetensors"), load_file(f"{source}/model.safetensors")
    assert tensors[f"{kept}.weight"].is_floating_point() and f"{kept}.weight_scale" not in tensors
    # No up_proj -> down_proj smoothing where down_proj stays float (it would buy nothing): stored as it was.
    assert torch.equal(tensors[f"{kept}.weight"], original[f"{kept}.weight"])
    norm = "model.layers.0.input_layernorm.weight"
    assert tensors[norm].dtype == original[norm].dtype and not torch.equal(tensors[norm], original[norm])
    llm = LLM(quantized, **ENGINE)
    _check_against_references(source, quantized, llm)


@pytest.mark.slow  # two worker processes (~30 s); test_w8a8_linear.py's simulated ranks cover the sharding
def test_tensor_parallel_2_equals_one_process(tiny_model_dir, tmp_path) -> None:
    quantized = _quantize(tiny_model_dir("llama"), str(tmp_path / "w8a8"))
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": prompt} for prompt in PROMPTS]
    single = [o.outputs[0].token_ids for o in LLM(quantized, **ENGINE).generate(prompts, params, use_tqdm=False)]
    tp2 = LLM(quantized, tensor_parallel_size=2, **ENGINE)
    try:
        assert [o.outputs[0].token_ids for o in tp2.generate(prompts, params, use_tqdm=False)] == single
    finally:
        tp2.llm_engine.shutdown()
    assert os.path.isfile(os.path.join(quantized, "model.safetensors"))
