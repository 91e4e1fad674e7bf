"""W8A8 int8 MoE experts: the grouped int8 experts (with the gate_up + SwiGLU + re-quant epilogue) against the
dense dequantize reference; expert parallel over two ranks equal to one, before and after an EPLB rebalance that
moves the int8 weights with their scales; Qwen3-MoE and DeepSeek-V3 checkpoints from `pagedserve quantize` equal
the HF float32 dequantize-then-run reference over 32 greedy tokens."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as multiprocessing
from safetensors import safe_open

from pagedserve import LLM
from pagedserve.layers.moe.fused_moe import FusedMoE
from pagedserve.layers.moe.w8a8_experts import reference_w8a8_experts
from pagedserve.layers.quantization.compressed_tensors_config import CompressedTensorsConfig
from pagedserve.layers.quantization.quantization_context import building_with_quantization
from test_w8a8_models import ENGINE, _check_against_references, _quantize
from w8a8_configs import w8a8_config

NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, NUM_REDUNDANT = 8, 2, 32, 24, 2
TOKEN_COUNTS = (13, 1, 0, 40)


def _expert_tensors() -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(0)

    def quantized(rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randint(-128, 128, (rows, columns), dtype=torch.int8, generator=generator),
                torch.rand(rows, 1, generator=generator) * 0.004 + 1e-4)

    return [{"w1": quantized(INTERMEDIATE, HIDDEN), "w3": quantized(INTERMEDIATE, HIDDEN),
             "w2": quantized(HIDDEN, INTERMEDIATE)} for _ in range(NUM_EXPERTS)]


def _build(**kwargs) -> FusedMoE:
    config = CompressedTensorsConfig.from_dict(w8a8_config())
    with building_with_quantization(config):
        layer = FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, renormalize=True, prefix="model.layers.0.mlp.experts",
                         **kwargs)
    for expert, tensors in enumerate(_expert_tensors()):
        for shard_id, (weight, scale) in tensors.items():
            stacked = "w2" if shard_id == "w2" else "w13"
            layer.weight_loader(getattr(layer, f"{stacked}_weight"), weight, shard_id, expert)
            layer.weight_loader(getattr(layer, f"{stacked}_weight_scale"), scale, shard_id, expert)
    return layer


def _inputs(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + num_tokens)
    return (torch.randn(num_tokens, HIDDEN, generator=generator),
            torch.randn(num_tokens, NUM_EXPERTS, generator=generator))


def test_w8a8_experts_equal_dequantize_reference() -> None:
    layer = _build()
    assert layer.is_quantized and layer.w13_weight.dtype == torch.int8
    for num_tokens in TOKEN_COUNTS:
        hidden, logits = _inputs(num_tokens)
        topk_weights, topk_ids = layer.route(logits)
        expected = reference_w8a8_experts(hidden, layer.w13_weight, layer.w13_weight_scale, layer.w2_weight,
                                          layer.w2_weight_scale, topk_weights, layer.physical_ids(topk_ids))
        torch.testing.assert_close(layer(hidden, logits), expected, atol=1e-5, rtol=1e-5)


def test_float_expert_weight_is_refused() -> None:
    layer = _build()
    with pytest.raises(ValueError, match=r"experts: expert 3 w1 weight has dtype torch\.float32.*int8"):
        layer.weight_loader(layer.w13_weight, torch.randn(INTERMEDIATE, HIDDEN), "w1", 3)
    with pytest.raises(ValueError, match=r"expert 3 w2 weight_scale has shape \(32,\), expected \(32, 1\)"):
        layer.weight_loader(layer.w2_weight_scale, torch.rand(HIDDEN), "w2", 3)


def test_static_moe_experts_are_refused() -> None:
    with building_with_quantization(CompressedTensorsConfig.from_dict(w8a8_config(static=True))):
        with pytest.raises(ValueError, match=r"experts: W8A8 MoE experts need .* dynamic per-token activations"):
            FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, prefix="model.layers.0.mlp.experts")


def _rank_main(rank: int, port: int, results) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed

    from pagedserve.distributed.parallel_state import GroupCoordinator
    from pagedserve.eplb.rebalancer import move_expert_weights

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = GroupCoordinator(name="ep", rank=rank, world_size=2, ranks=[0, 1],
                                 process_group=torch.distributed.group.WORLD)
        layer = _build(num_redundant_experts=NUM_REDUNDANT, ep_group=group, token_group=group)
        outputs = [layer(*_inputs(n)) for n in TOKEN_COUNTS]
        move_expert_weights(layer, torch.tensor([7, 6, 5, 4, 3, 2, 1, 0, 6, 7]))
        moved = [layer(*_inputs(n)) for n in TOKEN_COUNTS]
        results.put((rank, [o.numpy() for o in outputs], [m.numpy() for m in moved]))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow  # two spawned ranks (~25 s); the W8A8 expert compute is covered by the single-layer test
def test_expert_parallel_and_eplb_move_int8_experts_with_their_scales() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_rank_main, args=(rank, port, results)) for rank in range(2)]
    for process in processes:
        process.start()
    collected = {}
    for _ in range(2):
        rank, outputs, moved = results.get(timeout=120)
        collected[rank] = ([torch.from_numpy(o) for o in outputs], [torch.from_numpy(m) for m in moved])
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    reference_layer = _build()
    for index, num_tokens in enumerate(TOKEN_COUNTS):
        expected = reference_layer(*_inputs(num_tokens))
        for rank in range(2):
            # Each rank holds its half of the tokens' rows in the gathered output; the int8 path is exact per row.
            torch.testing.assert_close(collected[rank][0][index], expected, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(collected[rank][1][index], expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", ["qwen3-moe", pytest.param("deepseek-v3", marks=pytest.mark.slow)])
def test_w8a8_moe_model_equals_dequantized_reference(kind: str, tiny_model_dir, tmp_path) -> None:
    source = tiny_model_dir(kind)
    quantized = _quantize(source, str(tmp_path / "w8a8"))
    with safe_open(os.path.join(quantized, "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        assert handle.get_tensor("model.layers.1.mlp.experts.7.down_proj.weight").dtype == torch.int8
    assert "model.layers.1.mlp.experts.7.down_proj.weight_scale" in names
    assert "model.layers.1.mlp.gate.weight_scale" not in names  # the router stays float
    _check_against_references(source, quantized, LLM(quantized, **ENGINE))
