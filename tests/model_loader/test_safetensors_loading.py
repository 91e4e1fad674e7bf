"""load_model: safetensors streaming (single file and sharded), explicit weight streams, and errors."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from pagedserve.config.model import ModelConfig
from pagedserve.model_loader import iterate_safetensors_weights, load_model, safetensors_weight_files
from pagedserve.models.registry import resolve_model_class, supported_architectures


def _model_config(folder: str, dtype: torch.dtype = torch.float32) -> ModelConfig:
    return ModelConfig(model=folder, hf_config=AutoConfig.from_pretrained(folder, local_files_only=True),
                       dtype=dtype)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def _copy_without_weights(source: str, destination: str) -> str:
    os.makedirs(destination)
    for name in os.listdir(source):
        if not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            shutil.copy(os.path.join(source, name), destination)
    return destination


def test_sharded_checkpoint_loads_the_same_weights(tiny_model_dir) -> None:
    single = tiny_model_dir("qwen2")
    sharded = tiny_model_dir("qwen2", max_shard_size="40KB")
    shard_files = safetensors_weight_files(sharded)
    assert len(shard_files) > 1 and os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    expected = _state(load_model(_model_config(single), "cpu"))
    actual = _state(load_model(_model_config(sharded), "cpu"))
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=0, rtol=0, msg=name)


def test_fused_parameters_hold_the_checkpoint_slices(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    model = load_model(_model_config(folder), "cpu")
    checkpoint = load_file(os.path.join(folder, "model.safetensors"))
    prefix = "model.layers.1"
    qkv = model.get_parameter(f"{prefix}.self_attn.qkv_proj.weight")
    expected = torch.cat([checkpoint[f"{prefix}.self_attn.{name}.weight"] for name in ("q_proj", "k_proj", "v_proj")])
    torch.testing.assert_close(qkv, expected, atol=0, rtol=0)
    gate_up = model.get_parameter(f"{prefix}.mlp.gate_up_proj.weight")
    expected = torch.cat([checkpoint[f"{prefix}.mlp.{name}.weight"] for name in ("gate_proj", "up_proj")])
    torch.testing.assert_close(gate_up, expected, atol=0, rtol=0)


def test_bfloat16_conversion_while_streaming(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    dtypes = {tensor.dtype for _, tensor in iterate_safetensors_weights(folder, torch.bfloat16)}
    assert dtypes == {torch.bfloat16}
    model = load_model(_model_config(folder, torch.bfloat16), "cpu")
    assert {param.dtype for param in model.parameters()} == {torch.bfloat16}


def test_explicit_weight_stream_replaces_the_folder(tiny_model_dir, tmp_path) -> None:
    """Another weight source (e.g. GGUF) plugs in as an iterable of (HF name, tensor)."""
    folder = tiny_model_dir("llama")
    weights = list(iterate_safetensors_weights(folder))
    config = _model_config(folder)
    reference = _state(load_model(config, "cpu"))
    # The folder's safetensors are not read: point the config at a folder with none.
    empty = _copy_without_weights(folder, str(tmp_path / "no-weights"))
    actual = _state(load_model(ModelConfig(model=empty, hf_config=config.hf_config), "cpu", weights=iter(weights)))
    for name in reference:
        torch.testing.assert_close(actual[name], reference[name], atol=0, rtol=0, msg=name)


def test_missing_folder_is_a_value_error_naming_it(tmp_path) -> None:
    missing = str(tmp_path / "does-not-exist")
    with pytest.raises(ValueError, match="does-not-exist"):
        load_model(ModelConfig(model=missing, hf_config=None), "cpu")


def test_folder_without_safetensors_names_what_was_expected(tiny_model_dir, tmp_path) -> None:
    folder = _copy_without_weights(tiny_model_dir("llama"), str(tmp_path / "bare"))
    with pytest.raises(ValueError, match=r"bare.*has no \*\.safetensors files; expected model\.safetensors"):
        load_model(_model_config(folder), "cpu")


def test_missing_parameters_are_named(tiny_model_dir, tmp_path) -> None:
    source = tiny_model_dir("llama")
    folder = _copy_without_weights(source, str(tmp_path / "partial"))
    tensors = load_file(os.path.join(source, "model.safetensors"))
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    del tensors["model.norm.weight"]
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with pytest.raises(ValueError, match=r"no weights for 2 parameter\(s\): \['model.layers.0.self_attn.qkv_proj.weight', "
                                         r"'model.norm.weight'\]"):
        load_model(_model_config(folder), "cpu")


def test_unknown_checkpoint_tensor_is_rejected(tiny_model_dir, tmp_path) -> None:
    source = tiny_model_dir("llama")
    folder = _copy_without_weights(source, str(tmp_path / "extra"))
    tensors = load_file(os.path.join(source, "model.safetensors"))
    tensors["model.layers.0.mystery.weight"] = torch.zeros(2)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with pytest.raises(ValueError, match="'model.layers.0.mystery.weight' matches no parameter"):
        load_model(_model_config(folder), "cpu")


def test_index_naming_a_missing_shard_is_reported(tiny_model_dir, tmp_path) -> None:
    sharded = tiny_model_dir("qwen2", max_shard_size="40KB")
    folder = str(tmp_path / "broken")
    shutil.copytree(sharded, folder)
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        shard_name = sorted(set(json.load(f)["weight_map"].values()))[-1]
    os.remove(os.path.join(folder, shard_name))
    with pytest.raises(ValueError, match=f"names shard files that are missing: .*{shard_name}"):
        load_model(_model_config(folder), "cpu")


def test_registry_resolves_and_rejects_architectures(tiny_model_dir) -> None:
    config = AutoConfig.from_pretrained(tiny_model_dir("qwen3"), local_files_only=True)
    assert resolve_model_class(config).__name__ == "Qwen3ForCausalLM"
    assert supported_architectures() == sorted([
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
        "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"])
    config.architectures = ["GPTNeoXForCausalLM"]
    with pytest.raises(ValueError, match=r"architecture 'GPTNeoXForCausalLM' is not supported; supported: \["):
        resolve_model_class(config)
