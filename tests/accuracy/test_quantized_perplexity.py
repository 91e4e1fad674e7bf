"""Perplexity of the embedded SmolLM2-135M-Instruct on a fixed public-domain passage (tests/data, ~2,900 tokens),
quantized against unquantized, in float32 compute:
- the GGUF file's Q4_1 blocks kept quantized score the passage as the same file dequantized at load (within 0.1%),
  with prefill-sized chunks (dequantized tiles) and, over its first HEAD_TOKENS tokens, with 8-token chunks (the
  decode kernels' integer products);
- the W8A8 checkpoint `pagedserve quantize --ignore 're:.*down_proj$' --smoothquant-alpha 0.5 --calibration
  tests/data/calibration_text.txt` writes from the dequantized weights (every linear int8 but the MLP down
  projections, whose per-token int8 inputs cost this 135M model most of its loss; SmoothQuant on the norms): within
  +3% of those weights on the whole passage (slow test; the issue's target) and +8% on its first HEAD_TOKENS.
  Measured +1.1% and +6.2%; with every linear int8 and no smoothing +6.9% and +13.8% (docs/quantization.md).
  Each W8A8 number is one draw of the int8 rounding noise: float32-rounding-sized perturbations move the first
  HEAD_TOKENS' perplexity of this recipe between +2.5% and +7.8% (benchmarks/w8a8_perplexity_spread.py);
- the int8 KV cache: within +1% of the model's own cache, and the same greedy answers to the five chat prompts
  but where the model's own cache has a near tie."""
from __future__ import annotations

import os

import pytest
import torch

from generation_helpers import CHAT_QUESTIONS
from native_marks import NEEDS_GGUF_KERNELS
from pagedserve import LLM, SamplingParams
from pagedserve.model_loader.default_model import resolve_model_path
from perplexity import passage_text, perplexity

MAX_MODEL_LEN = 4096
NUM_KV_BLOCKS = 260  # 4,144 tokens: the passage in one request
# Tokens scored with 8-token chunks (one engine step each).
HEAD_TOKENS = 400
# The linears the W8A8 checkpoint keeps in float (`pagedserve quantize --ignore`).
W8A8_KEPT = r"re:.*down_proj$"
# int8 KV against the model's own cache: a greedy choice made by less than this many nats may turn (the int8 K
# error moves logprobs by up to ~0.2 nat on this model); logprobs kept per step to find the margin.
NEAR_TIE_NAT = 0.3
NUM_LOGPROBS = 20
# The W8A8 checkpoint's SmoothQuant calibration text (not the scored passage).
CALIBRATION_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                                "calibration_text.txt")


@pytest.fixture(scope="module")
def default_model_path() -> str:
    try:
        return resolve_model_path(None)
    except ValueError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def dequantized_perplexities(default_model_path: str) -> dict[str, float]:
    """The file dequantized at load: its perplexity on the passage ('all') and on its first HEAD_TOKENS ('head')."""
    llm = LLM(default_model_path, dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS,
              gguf_dequantize=True)
    return {"all": perplexity(llm, passage_text()), "head": perplexity(llm, passage_text(), HEAD_TOKENS)}


@pytest.fixture(scope="module")
def dequantized_perplexity(dequantized_perplexities: dict[str, float]) -> float:
    return dequantized_perplexities["all"]


@pytest.fixture(scope="module")
def hf_folders(default_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(the file's weights dequantized to float32 as an HF folder, its W8A8 checkpoint by `pagedserve quantize`
    with the down projections kept in float and SmoothQuant calibrated on tests/data/calibration_text.txt)."""
    from safetensors.torch import save_file

    from pagedserve.model_loader.gguf_loader import load_gguf
    from pagedserve.quantization.quantize_checkpoint import quantize_checkpoint

    root = tmp_path_factory.mktemp("smollm2")
    folder, quantized = str(root / "float32"), str(root / "w8a8")
    model = load_gguf(default_model_path, torch.float32)
    model.hf_config.save_pretrained(folder)
    model.tokenizer.save_pretrained(folder)
    save_file({name: tensor.contiguous() for name, tensor in model.weights(torch.float32)},
              os.path.join(folder, "model.safetensors"))
    quantize_checkpoint(folder, quantized, ignore=[W8A8_KEPT], smoothquant_alpha=0.5, calibration=CALIBRATION_PATH)
    return folder, quantized


def _perplexity_of(model: str, **options) -> float:
    llm = LLM(model, dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS, **options)
    return perplexity(llm, passage_text())


@NEEDS_GGUF_KERNELS
def test_gguf_kept_quantized_scores_the_passage_as_dequantized(default_model_path: str,
                                                               dequantized_perplexities: dict[str, float]) -> None:
    kept = _perplexity_of(default_model_path)
    assert 1.5 < dequantized_perplexities["all"] < 40  # a real model on real English
    assert abs(kept / dequantized_perplexities["all"] - 1) < 1e-3, (kept, dequantized_perplexities)


@NEEDS_GGUF_KERNELS
def test_gguf_decode_kernels_score_the_passage_as_dequantized(default_model_path: str,
                                                              dequantized_perplexities: dict[str, float]) -> None:
    """8-token chunks: every product runs on the decode kernels (int16 activations), none on dequantized tiles."""
    llm = LLM(default_model_path, dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS,
              max_num_batched_tokens=8)
    kept = perplexity(llm, passage_text(), HEAD_TOKENS)
    assert abs(kept / dequantized_perplexities["head"] - 1) < 1e-3, (kept, dequantized_perplexities)


def test_int8_kv_cache_stays_within_one_percent(default_model_path: str, dequantized_perplexity: float) -> None:
    """The file dequantized at load, with an int8 KV cache, against the same engine with the model's own cache."""
    int8_kv = _perplexity_of(default_model_path, gguf_dequantize=True, kv_cache_dtype="int8")
    assert int8_kv < dequantized_perplexity * 1.01, (int8_kv, dequantized_perplexity)


def test_w8a8_stays_within_eight_percent_on_the_passage_head(hf_folders: tuple[str, str],
                                                              dequantized_perplexities: dict[str, float]) -> None:
    """Measured +6.2% on the first 400 tokens (the whole passage is the issue's target). A smoke check: the
    perplexity of 400 W8A8 tokens is one draw of the rounding noise, +2.5% to +7.8% over five draws of float32-sized
    perturbations (docs/quantization.md, benchmarks/w8a8_perplexity_spread.py), so a change of float summation order
    alone can move it close to the bound."""
    _, quantized = hf_folders
    llm = LLM(quantized, dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS)
    w8a8 = perplexity(llm, passage_text(), HEAD_TOKENS)
    assert w8a8 < dequantized_perplexities["head"] * 1.08, (w8a8, dequantized_perplexities)


@pytest.mark.slow  # ~3 min (W8A8 prefill of 2,900 tokens in float32: torch's portable int8 GEMM)
def test_w8a8_stays_within_three_percent(hf_folders: tuple[str, str], dequantized_perplexity: float) -> None:
    """The issue's target. Measured +1.1%."""
    _, quantized = hf_folders
    w8a8 = _perplexity_of(quantized)
    assert w8a8 < dequantized_perplexity * 1.03, (w8a8, dequantized_perplexity)


def test_int8_kv_cache_keeps_the_chat_answers(default_model_path: str) -> None:
    """The five chat prompts' greedy answers with the int8 KV cache against the model's own cache: identical, or
    parted only where the model's own cache has a near tie (docs/quantization.md, "int8 KV cache: accuracy").

    Measured, float32: on an AMD Zen 3 (AVX2) four answers identical over 32 tokens, the photosynthesis one parting at
    token 23 (" as" ahead of " and" by 0.020 nat in the model's own cache); on an Intel Emerald Rapids (AMX, at every
    PAGEDSERVE_CPU_ISA cap) three identical, the photosynthesis one at token 23 and the sea haiku at token 1
    (" waves" ahead of " sea" by 0.14 nat). The int8 K error moves a token's logprob by up to ~0.2 nat, so a choice
    the model's own cache makes by less than NEAR_TIE_NAT may turn; a broken cache parts early by whole nats."""
    conversations = [[{"role": "user", "content": question}] for question in CHAT_QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=NUM_LOGPROBS)
    outputs = {}
    for kv_cache_dtype in ("auto", "int8"):
        llm = LLM(default_model_path, dtype="float32", max_model_len=512, num_kv_blocks=64,
                  kv_cache_dtype=kv_cache_dtype)
        outputs[kv_cache_dtype] = [output.outputs[0] for output in llm.chat(conversations, params, use_tqdm=False)]
        del llm
    num_identical = 0
    for question, own, int8 in zip(CHAT_QUESTIONS, outputs["auto"], outputs["int8"]):
        parting = next((i for i, (a, b) in enumerate(zip(own.token_ids, int8.token_ids)) if a != b), None)
        if parting is None:
            num_identical += 1
            continue
        own_logprobs = own.logprobs[parting]
        int8_token = int8.token_ids[parting]
        assert int8_token in own_logprobs, (question, parting, int8_token, own_logprobs)
        margin = own_logprobs[own.token_ids[parting]].logprob - own_logprobs[int8_token].logprob
        assert margin < NEAR_TIE_NAT, (question, parting, margin)
    assert num_identical >= 3, num_identical
