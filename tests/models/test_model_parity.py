"""pagedserve models vs HF transformers on tiny random models (float32, logits within 1e-4)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from paged_inputs import ScratchPagedRunner
from pagedserve.attention.forward_context import set_forward_context
from pagedserve.config.model import ModelConfig
from pagedserve.model_loader import load_model

KINDS = ["llama", "llama-tied", "qwen2", "qwen2-sliding", "qwen3", "mistral"]
ATOL = 1e-4
# Longer than mistral's sliding window (16) and than one block (16), so both paths matter.
PROMPT_LENGTHS = {"a": 5, "b": 37, "c": 21}


def _load_both(folder: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
    model = load_model(ModelConfig(model=folder, hf_config=hf_config, dtype=torch.float32), "cpu")
    reference = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    return model, reference


def _prompts(vocab_size: int) -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(1234)
    return {request_id: torch.randint(3, vocab_size, (length,), generator=generator).tolist()
            for request_id, length in PROMPT_LENGTHS.items()}


@torch.no_grad()
def _reference_logits(reference: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    return reference(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(scope="module", params=KINDS)
def loaded(request: pytest.FixtureRequest, tiny_model_dir) -> tuple[str, torch.nn.Module, torch.nn.Module]:
    model, reference = _load_both(tiny_model_dir(request.param))
    return request.param, model, reference


def test_prefill_then_decode_matches_hf(loaded) -> None:
    kind, model, reference = loaded
    prompts = _prompts(model.config.vocab_size)
    runner = ScratchPagedRunner(model, block_size=16, num_blocks=32)
    outputs = runner.step(prompts)
    sequences = {request_id: list(tokens) for request_id, tokens in prompts.items()}
    for request_id, logits in outputs.items():
        expected = _reference_logits(reference, sequences[request_id])
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0, msg=f"{kind} prefill {request_id}")
    # Greedy decode: single-token steps against HF's full forward over the grown sequence.
    for _ in range(4):
        next_tokens = {request_id: [int(logits[-1].argmax())] for request_id, logits in outputs.items()}
        for request_id, tokens in next_tokens.items():
            sequences[request_id] += tokens
        outputs = runner.step(next_tokens)
        for request_id, logits in outputs.items():
            expected = _reference_logits(reference, sequences[request_id])[-1:]
            torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0, msg=f"{kind} decode {request_id}")


def test_chunked_prefill_mixed_with_decode_matches_hf(loaded) -> None:
    kind, model, reference = loaded
    prompts = _prompts(model.config.vocab_size)
    runner = ScratchPagedRunner(model, block_size=16, num_blocks=32)
    # Step 1: short prompt whole, long prompt's first chunk (crosses a block boundary mid-chunk).
    first = runner.step({"a": prompts["a"], "b": prompts["b"][:19]})
    decoded = int(first["a"][-1].argmax())
    # Step 2: a decode first, then the rest of the long prompt.
    second = runner.step({"a": [decoded], "b": prompts["b"][19:]})
    expected_b = _reference_logits(reference, prompts["b"])
    torch.testing.assert_close(torch.cat([first["b"], second["b"]]), expected_b, atol=ATOL, rtol=0,
                               msg=f"{kind} chunked prefill")
    expected_a = _reference_logits(reference, prompts["a"] + [decoded])[-1:]
    torch.testing.assert_close(second["a"], expected_a, atol=ATOL, rtol=0, msg=f"{kind} decode in mixed batch")


def test_dummy_run_without_metadata_matches_hf(loaded) -> None:
    kind, model, reference = loaded
    tokens = _prompts(model.config.vocab_size)["b"]
    with torch.no_grad(), set_forward_context(None):
        hidden_states = model(torch.tensor(tokens), torch.arange(len(tokens)))
    logits = model.compute_logits(hidden_states)
    torch.testing.assert_close(logits, _reference_logits(reference, tokens), atol=ATOL, rtol=0, msg=kind)


def test_logits_are_float32_and_vocab_sized(loaded) -> None:
    _, model, _ = loaded
    with torch.no_grad(), set_forward_context(None):
        hidden_states = model(torch.tensor([1, 2, 3]), torch.arange(3))
    logits = model.compute_logits(hidden_states)
    assert hidden_states.shape == (3, model.config.hidden_size)
    assert logits.dtype == torch.float32 and logits.shape == (3, model.config.vocab_size)


def test_tied_embeddings_share_one_parameter(tiny_model_dir) -> None:
    tied, _ = _load_both(tiny_model_dir("llama-tied"))
    untied, _ = _load_both(tiny_model_dir("llama-untied"))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(tied.named_parameters())
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


def test_bfloat16_model_tracks_float32(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
    model = load_model(ModelConfig(model=folder, hf_config=hf_config, dtype=torch.bfloat16), "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    _, reference = _load_both(folder)
    tokens = _prompts(hf_config.vocab_size)["c"]
    logits = ScratchPagedRunner(model, block_size=16, num_blocks=8).step({"c": tokens})["c"]
    assert logits.dtype == torch.float32
    expected = _reference_logits(reference, tokens)
    # bf16 carries ~3 significant digits; logits are scaled up (~10), so compare loosely and by argmax.
    assert (logits - expected).abs().max() < 1.0
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


def test_per_layer_sliding_window_follows_the_config(tiny_model_dir) -> None:
    windows = {}
    for kind in ("mistral", "qwen2", "qwen2-sliding", "llama"):
        model, _ = _load_both(tiny_model_dir(kind))
        windows[kind] = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == {"mistral": [16, 16], "qwen2": [None, None], "qwen2-sliding": [None, 16],
                       "llama": [None, None]}


@pytest.mark.parametrize("kind", ["llama-rope-llama3", "llama-rope-linear", "llama-rope-dynamic", "llama-rope-yarn"])
def test_rope_scaled_models_match_hf(kind: str, tiny_model_dir) -> None:
    model, reference = _load_both(tiny_model_dir(kind))
    prompts = _prompts(model.config.vocab_size)
    outputs = ScratchPagedRunner(model, block_size=16, num_blocks=16).step({"b": prompts["b"], "c": prompts["c"]})
    for request_id, logits in outputs.items():
        torch.testing.assert_close(logits, _reference_logits(reference, prompts[request_id]), atol=ATOL, rtol=0,
                                   msg=f"{kind} {request_id}")
