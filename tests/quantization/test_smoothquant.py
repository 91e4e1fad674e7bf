"""SmoothQuant in `pagedserve quantize` (quantization/smoothquant.py): the smoothed float model computes what the
original computes, the factors land where the formula puts them, and the mappings are the ones the module
docstring names."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pagedserve.quantization.calibration import collect_input_channel_absmax, read_calibration_sequences
from pagedserve.quantization.quantize_checkpoint import _module_names
from pagedserve.quantization.smoothquant import compute_smoothing, smoothing_mappings
from tiny_models import tiny_corpus

ALPHA = 0.5


@pytest.fixture
def smoothed_llama(tiny_model_dir, tmp_path) -> tuple[str, list, object, dict[str, torch.Tensor]]:
    """(folder, mappings, smoothing, channel maxima) of the tiny Llama calibrated on the tiny corpus."""
    folder = tiny_model_dir("llama")
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("\n".join(tiny_corpus()))
    linears, norms = _module_names(folder)
    mappings = smoothing_mappings(linears, norms)
    sequences = read_calibration_sequences(folder, str(calibration))
    absmax = collect_input_channel_absmax(folder, sequences, [mapping.balance[0] for mapping in mappings])
    weights = load_file(f"{folder}/model.safetensors")
    smoothing = compute_smoothing(mappings, absmax, {name: weights[f"{name}.weight"] for mapping in mappings
                                                     for name in mapping.balance}, ALPHA)
    return folder, sequences, smoothing, absmax


def test_mappings_of_a_llama_layer(tiny_model_dir) -> None:
    linears, norms = _module_names(tiny_model_dir("llama"))
    mappings = smoothing_mappings(linears, norms)
    layer = "model.layers.1"
    assert [(m.smooth, m.balance) for m in mappings if m.smooth.startswith(f"{layer}.")] == [
        (f"{layer}.input_layernorm", (f"{layer}.self_attn.q_proj", f"{layer}.self_attn.k_proj",
                                      f"{layer}.self_attn.v_proj")),
        (f"{layer}.post_attention_layernorm", (f"{layer}.mlp.gate_proj", f"{layer}.mlp.up_proj")),
        (f"{layer}.mlp.up_proj", (f"{layer}.mlp.down_proj",)),
    ]


def test_moe_layers_smooth_attention_only(tiny_model_dir) -> None:
    """In a MoE layer the post-attention norm also feeds the router: no mapping there."""
    linears, norms = _module_names(tiny_model_dir("qwen3-moe"))
    smooth = {mapping.smooth.split(".", 3)[3] for mapping in smoothing_mappings(linears, norms)}
    assert smooth == {"input_layernorm"}


@torch.no_grad()
def test_smoothed_float_model_computes_the_same_and_its_inputs_are_smoothed(smoothed_llama) -> None:
    folder, sequences, smoothing, absmax = smoothed_llama
    original = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    smoothed = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    for name, parameter in smoothed.named_parameters():
        parameter.copy_(smoothing.apply(name, parameter))
    changed = [name for name, parameter in smoothed.named_parameters()
               if not torch.equal(parameter, original.get_parameter(name))]
    # Per layer: both norms, q/k/v, gate, up (rows and columns), down.
    assert len(changed) == 8 * original.config.num_hidden_layers, changed
    tokens = torch.tensor([sequences[0]])
    assert torch.allclose(smoothed(tokens).logits, original(tokens).logits, atol=1e-4, rtol=1e-4)
    # Each balance linear now sees max|x_c| / s_c = max|x_c| ** (1 - alpha) * max|W_c| ** alpha per channel.
    first_balances = [mapping.balance[0] for mapping in smoothing.mappings]
    smoothed_absmax = _channel_absmax(smoothed, sequences, first_balances)
    for mapping, factors in zip(smoothing.mappings, smoothing.scales):
        expected = absmax[mapping.balance[0]] / factors
        assert torch.allclose(smoothed_absmax[mapping.balance[0]], expected, rtol=1e-4, atol=1e-6), mapping


def _channel_absmax(model: torch.nn.Module, sequences: list[list[int]], names: list[str]) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    handles = [modules[name].register_forward_pre_hook(
        lambda module, args, name=name: found.__setitem__(name, torch.maximum(
            found.get(name, torch.zeros(args[0].shape[-1])), args[0].reshape(-1, args[0].shape[-1]).abs().amax(0))))
        for name in names]
    for sequence in sequences:
        model(torch.tensor([sequence]))
    for handle in handles:
        handle.remove()
    return found
