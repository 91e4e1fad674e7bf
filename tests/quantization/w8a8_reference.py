"""The independent oracle of the W8A8 model tests: HF transformers in float32 with the checkpoint's int8 weights
dequantized into its linears and their inputs fake-quantized to int8 (per token, or with the static scale)."""
from __future__ import annotations

import torch
from safetensors.torch import load_file


def _dynamic_fake_quant(module: torch.nn.Module, args: tuple) -> tuple:
    x = args[0]
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (torch.round(x / safe).clamp(-127, 127) * scale,) + args[1:]


def _static_fake_quant(scale: torch.Tensor):  # type: ignore[no-untyped-def]
    def hook(module: torch.nn.Module, args: tuple) -> tuple:
        return (torch.round(args[0] / scale).clamp(-128, 127) * scale,) + args[1:]

    return hook


def _fake_quant(x: torch.Tensor) -> torch.Tensor:
    return _dynamic_fake_quant(None, (x,))[0]  # type: ignore[arg-type]


def _w8a8_experts_forward(experts: torch.nn.Module):  # type: ignore[no-untyped-def]
    """HF's per-expert loop (Qwen3MoeExperts.forward) with each GEMM input fake-quantized per token."""
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        output = torch.zeros_like(hidden_states)
        for expert in range(experts.gate_up_proj.shape[0]):
            top_k_position, token_index = torch.where(top_k_index.t() == expert)
            if token_index.numel() == 0:
                continue
            gate, up = torch.nn.functional.linear(_fake_quant(hidden_states[token_index]),
                                                  experts.gate_up_proj[expert]).chunk(2, dim=-1)
            activated = _fake_quant(experts.act_fn(gate) * up)
            expert_out = torch.nn.functional.linear(activated, experts.down_proj[expert])
            output.index_add_(0, token_index, expert_out * top_k_weights[token_index, top_k_position, None])
        return output

    return forward


def _dequantize_experts(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> int:
    """Dequantized per-expert checkpoint tensors into HF's stacked expert parameters; returns how many blocks."""
    def dequantized(name: str) -> torch.Tensor:
        return tensors[f"{name}.weight"].float() * tensors[f"{name}.weight_scale"].float()

    num_blocks = 0
    for name, module in model.named_modules():
        if not (hasattr(module, "gate_up_proj") and hasattr(module, "down_proj")
                and isinstance(module.gate_up_proj, torch.nn.Parameter)):
            continue
        if f"{name}.0.gate_proj.weight_scale" not in tensors:
            continue
        for expert in range(module.gate_up_proj.shape[0]):
            module.gate_up_proj[expert].copy_(torch.cat([dequantized(f"{name}.{expert}.gate_proj"),
                                                         dequantized(f"{name}.{expert}.up_proj")]))
            module.down_proj[expert].copy_(dequantized(f"{name}.{expert}.down_proj"))
        module.forward = _w8a8_experts_forward(module)
        num_blocks += 1
    return num_blocks


def dequantized_hf_model(source_folder: str, quantized_folder: str) -> torch.nn.Module:
    """The float model of `source_folder` running the quantized checkpoint's W8A8 arithmetic in float32 (MoE
    experts too, when the checkpoint quantizes them), with the checkpoint's float tensors (norms and kept linears,
    which SmoothQuant changes)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source_folder, local_files_only=True, dtype=torch.float32).eval()
    tensors = load_file(f"{quantized_folder}/model.safetensors")
    num_quantized = 0
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            stored = tensors.get(name)
            if stored is not None and stored.is_floating_point() and stored.shape == parameter.shape:
                parameter.copy_(stored.float())
        for name, module in model.named_modules():
            scale = tensors.get(f"{name}.weight_scale")
            if scale is None:
                continue
            module.weight.copy_(tensors[f"{name}.weight"].float() * scale.float())
            input_scale = tensors.get(f"{name}.input_scale")
            module.register_forward_pre_hook(_dynamic_fake_quant if input_scale is None
                                             else _static_fake_quant(input_scale.float()))
            num_quantized += 1
        num_quantized += _dequantize_experts(model, tensors)
    assert num_quantized > 0
    return model


@torch.no_grad()
def greedy_with_logprobs(model: torch.nn.Module, prompt: list[int], max_new_tokens: int
                         ) -> tuple[list[int], list[float]]:
    """Greedy tokens and each chosen token's logprob (EOS does not stop)."""
    input_ids = torch.tensor([prompt])
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, eos_token_id=None,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(torch.log_softmax(logits[0].float(), -1)[token]) for logits, token in zip(out.logits, tokens)]
    return tokens, logprobs


@torch.no_grad()
def teacher_forced_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """The logprob `model` gives each of `tokens` after the prompt and the tokens before it."""
    sequence = torch.tensor([prompt + tokens])
    logprobs = torch.log_softmax(model(sequence).logits[0].float(), -1)
    return [float(logprobs[len(prompt) - 1 + step, token]) for step, token in enumerate(tokens)]
