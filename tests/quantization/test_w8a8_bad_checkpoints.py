"""Bad W8A8 checkpoints fail with errors naming the tensor and the field; config errors come before any layer is
built, weight errors before the model is returned (nothing half-loaded is handed out)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from pagedserve.config.model import ModelConfig
from pagedserve.model_loader import load_model
from pagedserve.quantization.quantize_checkpoint import quantize_checkpoint
from w8a8_configs import w8a8_config


@pytest.fixture(scope="module")
def quantized(tiny_model_dir, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("w8a8-bad") / "w8a8")
    quantize_checkpoint(tiny_model_dir("llama"), out)
    return out


def _copy(folder: str, tmp_path, *, config_change=None, tensors_change=None) -> str:  # type: ignore[no-untyped-def]
    target = str(tmp_path / "checkpoint")
    shutil.copytree(folder, target)
    if config_change is not None:
        path = os.path.join(target, "config.json")
        with open(path) as handle:
            config = json.load(handle)
        config_change(config)
        with open(path, "w") as handle:
            json.dump(config, handle)
    if tensors_change is not None:
        path = os.path.join(target, "model.safetensors")
        tensors = load_file(path)
        tensors_change(tensors)
        save_file(tensors, path)
    return target


def _load(folder: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
    return load_model(ModelConfig(model=folder, hf_config=hf_config, dtype=dtype), "cpu")


def test_good_checkpoint_loads_int8_layers(quantized: str) -> None:
    model = _load(quantized)
    layer = model.model.layers[0].mlp.down_proj
    assert layer.weight.dtype == torch.int8 and layer.linear_method.is_quantized
    assert model.lm_head.weight.dtype == torch.float32  # ignored by the config


def test_bfloat16_model_keeps_float32_scales(quantized: str) -> None:
    model = _load(quantized, torch.bfloat16)
    layer = model.model.layers[0].self_attn.qkv_proj
    file_scales = load_file(os.path.join(quantized, "model.safetensors"))
    expected = torch.cat([file_scales[f"model.layers.0.self_attn.{name}_proj.weight_scale"] for name in "qkv"])
    assert layer.weight_scale.dtype == torch.float32 and torch.equal(layer.weight_scale, expected)
    assert model.model.layers[0].input_layernorm.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("change, message", [
    (lambda group: group["weights"].update(num_bits=4), r"config_groups\.group_0\.weights: num_bits=4"),
    (lambda group: (group["weights"].update(type="float"), group["input_activations"].update(type="float")),
     r"config_groups\.group_0\.weights: num_bits=8 type='float'"),
    (lambda group: group.pop("input_activations"), r"group_0\.input_activations is missing.*W8A16"),
    (lambda group: group["input_activations"].update(symmetric=False), r"input_activations\.symmetric=False"),
    (lambda group: group["weights"].update(strategy="group", group_size=32), r"weights\.strategy='group'"),
])
def test_unsupported_scheme_names_group_and_field(quantized: str, tmp_path, change, message: str) -> None:
    folder = _copy(quantized, tmp_path,
                   config_change=lambda config: change(config["quantization_config"]["config_groups"]["group_0"]))
    with pytest.raises(ValueError, match=message):
        _load(folder)


def test_other_quant_method_is_refused(quantized: str, tmp_path) -> None:
    folder = _copy(quantized, tmp_path, config_change=lambda config: config["quantization_config"].update(
        quant_method="gptq"))
    with pytest.raises(ValueError, match=r"quant_method='gptq' is not supported"):
        _load(folder)


def test_missing_scale_names_the_tensor(quantized: str, tmp_path) -> None:
    folder = _copy(quantized, tmp_path, tensors_change=lambda tensors: tensors.pop(
        "model.layers.1.mlp.down_proj.weight_scale"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight_scale"):
        _load(folder)


def test_wrong_scale_shape_names_the_tensor_and_field(quantized: str, tmp_path) -> None:
    def flatten(tensors: dict[str, torch.Tensor]) -> None:
        name = "model.layers.0.self_attn.k_proj.weight_scale"
        tensors[name] = tensors[name].reshape(-1).contiguous()

    folder = _copy(quantized, tmp_path, tensors_change=flatten)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight_scale \(part 'k' of the "
                                         r"fused layer\): checkpoint tensor has shape \(32,\), expected \(32, 1\)"):
        _load(folder)


def test_float_weights_under_a_quantized_config_are_refused(tiny_model_dir, tmp_path) -> None:
    folder = _copy(tiny_model_dir("llama"), tmp_path,
                   config_change=lambda config: config.update(quantization_config=w8a8_config()))
    with pytest.raises(ValueError, match=r"\.weight: checkpoint tensor has dtype torch\.float32.*int8"):
        _load(folder)


def test_static_moe_experts_are_refused_before_building(tiny_model_dir, tmp_path) -> None:
    folder = _copy(tiny_model_dir("qwen3-moe"), tmp_path,
                   config_change=lambda config: config.update(quantization_config=w8a8_config(static=True)))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts: W8A8 MoE experts need per-channel "
                                         r"weight scales and dynamic per-token activations"):
        _load(folder)


def test_quantize_command_refuses_bad_requests(tiny_model_dir, quantized: str, tmp_path) -> None:
    source = tiny_model_dir("llama")
    with pytest.raises(ValueError, match=r"scheme='w4a16' is not supported"):
        quantize_checkpoint(source, str(tmp_path / "a"), scheme="w4a16")
    with pytest.raises(ValueError, match=r"static=True needs calibration"):
        quantize_checkpoint(source, str(tmp_path / "b"), static=True)
    with pytest.raises(ValueError, match=r"already quantized"):
        quantize_checkpoint(quantized, str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"exists and is not empty"):
        quantize_checkpoint(source, quantized)
    with pytest.raises(ValueError, match=r"smoothquant_alpha needs calibration"):
        quantize_checkpoint(source, str(tmp_path / "d"), smoothquant_alpha=0.5)
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("some text for the float model to read")
    with pytest.raises(ValueError, match=r"smoothquant_alpha=1.5 must be in \[0, 1\]"):
        quantize_checkpoint(source, str(tmp_path / "e"), calibration=str(calibration), smoothquant_alpha=1.5)
    with pytest.raises(ValueError, match=r"ignore entry 're:.*down_prj' matches no linear module"):
        quantize_checkpoint(source, str(tmp_path / "f"), ignore=["re:.*down_prj"])
    with pytest.raises(ValueError, match=r"ignore keeps 'model.layers.0.self_attn.q_proj' but not all of"):
        quantize_checkpoint(source, str(tmp_path / "g"), ignore=["model.layers.0.self_attn.q_proj"])


def test_weight_layouts_leave_int8_layers_alone(quantized: str) -> None:
    from pagedserve.layers.weight_layout import (PREPACKED_LAYOUT, apply_weight_layout, can_prepack_on_cpu,
                                                 restore_plain_layout, weight_layout_of)

    model = _load(quantized)
    assert weight_layout_of(model) == {"w8a8_int8": 8}  # 2 layers x (qkv, o, gate_up, down)
    layer = model.model.layers[1].self_attn.o_proj
    weight, method = layer.weight, layer.linear_method
    if can_prepack_on_cpu(torch.float32):
        assert apply_weight_layout(model, PREPACKED_LAYOUT) == 1  # the LM head only
    assert restore_plain_layout(model) <= 1
    assert layer.weight is weight and layer.linear_method is method and weight.dtype == torch.int8
    assert weight_layout_of(model) == {"w8a8_int8": 8}
