"""A W8A8 checkpoint that keeps some linears in float (`pagedserve quantize --ignore 're:.*down_proj$'`) runs each
linear as its checkpoint says: on the very input the engine gave it during a prefill, every quantized linear
(fused q/k/v, o, fused gate/up) computes the reference arithmetic (per-token int8 activation times the stored int8
weight and scales, tests/quantization/w8a8_reference.py's), and every ignored down projection computes a float
product with the stored float weight (not quantized, not left at its initial values).

The comparison is per module on the same input on purpose: whole-model outputs of two correct W8A8 implementations
part after the first activation their float orders round to different int8 codes, and the difference snowballs
(issue #30: benchmarks/w8a8_perplexity_spread.py), so only a per-module check can be tight."""
from __future__ import annotations

import torch
from safetensors.torch import load_file

from pagedserve import LLM, SamplingParams
from pagedserve.cli import main as cli_main

PROMPT = [300, 12, 7, 250, 61, 33, 90, 101, 14, 2, 77, 45, 19, 200, 5, 66, 31]
KEPT = r"re:.*down_proj$"
# Largest relative row error against the reference: the engine's int32 accumulators scaled once against float32
# dot products of dequantized values (the int8 codes are bitwise the same: same division and rounding).
ROW_TOLERANCE = 1e-5
# The checkpoint parts of a fused layer, in the order of its output rows.
PARTS = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _per_token_fake_quant(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round(x / safe).clamp(-127, 127) * scale


def test_each_linear_of_a_mixed_checkpoint_computes_its_stored_weights(tiny_model_dir, tmp_path) -> None:
    source = tiny_model_dir("llama")
    quantized = str(tmp_path / "w8a8-ignore")
    assert cli_main(["quantize", "--model", source, "--out", quantized, "--ignore", KEPT]) == 0
    tensors = load_file(f"{quantized}/model.safetensors")
    llm = LLM(quantized, dtype="float32", max_model_len=256, num_kv_blocks=64)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    captured: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, module in model.named_modules():
        if ".layers." in name and name.endswith("_proj"):
            module.register_forward_hook(
                lambda module, args, output, name=name: captured.setdefault(name, []).append(
                    (args[0].detach().clone(), output.detach().clone())))
    # One token: the prompt's prefill is the only forward (decode steps may take the native decode stack, which
    # runs the layers without their module forwards).
    llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)

    num_layers = len(model.model.layers)
    expected = {f"model.layers.{i}.{kind}" for i in range(num_layers)
                for kind in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    assert set(captured) == expected
    for name, calls in captured.items():
        x = torch.cat([call[0] for call in calls]).float()
        y = torch.cat([call[1] for call in calls]).float()
        assert x.shape[0] == len(PROMPT)
        head, _, last = name.rpartition(".")
        parts = [f"{head}.{part}" for part in PARTS.get(last, [last])]
        if last == "down_proj":
            # Kept in float: the stored float weight, nothing quantized (no scale in the file or on the module).
            assert all(tensors[f"{part}.weight"].is_floating_point() for part in parts)
            assert not hasattr(dict(model.named_modules())[name], "weight_scale"), name
            weight, x_in = torch.cat([tensors[f"{part}.weight"].float() for part in parts]), x
        else:
            assert all(tensors[f"{part}.weight"].dtype == torch.int8 for part in parts), name
            weight = torch.cat([tensors[f"{part}.weight"].float() * tensors[f"{part}.weight_scale"].float()
                                for part in parts])
            x_in = _per_token_fake_quant(x)
        reference = x_in @ weight.t()
        row_error = (y - reference).norm(dim=-1) / reference.norm(dim=-1)
        assert float(row_error.max()) < ROW_TOLERANCE, (name, float(row_error.max()))
