"""Fused MoE on the CPU: routing against HF's routers, grouped experts against the dense reference,
per-expert checkpoint loading into stacked weights, and the shared-expert overlap flag."""
from __future__ import annotations

import pytest
import torch

from pagedserve.layers.moe.expert_placement import identity_placement, replica_map
from pagedserve.layers.moe.fused_experts import fused_experts, reference_experts
from pagedserve.layers.moe.fused_moe import FusedMoE
from pagedserve.layers.moe.moe_options import MoeOptions, use_moe_options
from pagedserve.layers.moe.router import select_experts

NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 32, 24, 2


def _weights(num_slots: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_slots, 2 * INTERMEDIATE, HIDDEN, generator=generator) * 0.2
    w2 = torch.randn(num_slots, HIDDEN, INTERMEDIATE, generator=generator) * 0.2
    return w13, w2


@pytest.mark.parametrize("num_tokens", [1, 16, 128])
def test_fused_experts_equal_reference(num_tokens: int) -> None:
    torch.manual_seed(num_tokens)
    w13, w2 = _weights(NUM_EXPERTS)
    hidden = torch.randn(num_tokens, HIDDEN)
    weights, ids = select_experts(torch.randn(num_tokens, NUM_EXPERTS), TOP_K, renormalize=True)
    fused = fused_experts(hidden, w13, w2, weights, ids)
    reference = reference_experts(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)


def test_fused_experts_skewed_routing_and_empty_batch() -> None:
    w13, w2 = _weights(NUM_EXPERTS)
    hidden = torch.randn(40, HIDDEN)
    ids = torch.zeros(40, TOP_K, dtype=torch.long)
    ids[:, 1] = 7  # every token to experts 0 and 7, the rest idle
    weights = torch.rand(40, TOP_K)
    torch.testing.assert_close(fused_experts(hidden, w13, w2, weights, ids),
                               reference_experts(hidden, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    empty = fused_experts(hidden[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, HIDDEN)


def _hf_router_case(kind: str):
    """(HF router module, our routing kwargs) for one family, with random weights and biases."""
    from transformers import DeepseekV2Config, DeepseekV3Config, Qwen3MoeConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    generator = torch.Generator().manual_seed(1)
    if kind == "softmax-renormalize":
        config = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K,
                                norm_topk_prob=True)
        router = Qwen3MoeTopKRouter(config)
        kwargs = dict(renormalize=True)
    elif kind == "group-limited-greedy":
        config = DeepseekV2Config(hidden_size=HIDDEN, n_routed_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K,
                                  topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                  routed_scaling_factor=1.7)
        router = DeepseekV2TopkRouter(config)
        kwargs = dict(num_expert_group=4, topk_group=2, group_score="max", routed_scaling_factor=1.7)
    else:
        config = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K,
                                  n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
        router = DeepseekV3TopkRouter(config)
        router.e_score_correction_bias.copy_(torch.randn(NUM_EXPERTS, generator=generator) * 0.3)
        kwargs = dict(scoring_func="sigmoid", renormalize=True, num_expert_group=4, topk_group=2,
                      group_score="top2_sum", e_score_correction_bias=router.e_score_correction_bias,
                      routed_scaling_factor=2.5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
    return router, kwargs


@pytest.mark.parametrize("kind", ["softmax-renormalize", "group-limited-greedy", "noaux-tc-sigmoid"])
def test_select_experts_matches_transformers_routers(kind: str) -> None:
    router, kwargs = _hf_router_case(kind)
    hidden = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
    weights, ids = select_experts(logits, TOP_K, **kwargs)
    # Same experts with the same weights (HF may return them unsorted): compare as per-token dense rows.
    expected = torch.zeros(64, NUM_EXPERTS).scatter_(1, hf_ids, hf_weights.float())
    actual = torch.zeros(64, NUM_EXPERTS).scatter_(1, ids, weights)
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6)


def test_select_experts_rejects_bad_top_k() -> None:
    with pytest.raises(ValueError, match="top_k=9"):
        select_experts(torch.randn(3, NUM_EXPERTS), 9)


def _load_layer(layer: FusedMoE, gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor]) -> None:
    for expert in range(NUM_EXPERTS):
        layer.weight_loader(layer.w13_weight, gate[expert], "w1", expert)
        layer.weight_loader(layer.w13_weight, up[expert], "w3", expert)
        layer.weight_loader(layer.w2_weight, down[expert], "w2", expert)


def test_fused_moe_layer_loads_per_expert_tensors_and_matches_dense_experts() -> None:
    generator = torch.Generator().manual_seed(3)
    gate = [torch.randn(INTERMEDIATE, HIDDEN, generator=generator) for _ in range(NUM_EXPERTS)]
    up = [torch.randn(INTERMEDIATE, HIDDEN, generator=generator) for _ in range(NUM_EXPERTS)]
    down = [torch.randn(HIDDEN, INTERMEDIATE, generator=generator) for _ in range(NUM_EXPERTS)]
    layer = FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, renormalize=True)
    _load_layer(layer, gate, up, down)
    hidden = torch.randn(20, HIDDEN, generator=generator)
    logits = torch.randn(20, NUM_EXPERTS, generator=generator)
    output = layer(hidden, logits)
    # Independent dense computation straight from the per-expert tensors.
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    expected = torch.zeros_like(hidden)
    for token in range(20):
        for k in range(TOP_K):
            e = int(ids[token, k])
            activated = torch.nn.functional.silu(gate[e] @ hidden[token]) * (up[e] @ hidden[token])
            expected[token] += weights[token, k] * (down[e] @ activated)
    torch.testing.assert_close(output, expected, atol=1e-4, rtol=1e-4)
    # The load counter saw every routed pair.
    assert int(layer.expert_load.sum()) == 20 * TOP_K
    assert layer.expert_load.tolist() == torch.bincount(ids.flatten(), minlength=NUM_EXPERTS).tolist()


def test_fused_moe_weight_loader_rejects_bad_input() -> None:
    layer = FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE)
    with pytest.raises(ValueError, match="shard_id='w4'"):
        layer.weight_loader(layer.w13_weight, torch.zeros(INTERMEDIATE, HIDDEN), "w4", 0)
    with pytest.raises(ValueError, match="expert_id=8"):
        layer.weight_loader(layer.w13_weight, torch.zeros(INTERMEDIATE, HIDDEN), "w1", 8)
    with pytest.raises(ValueError, match="shape"):
        layer.weight_loader(layer.w2_weight, torch.zeros(INTERMEDIATE, HIDDEN), "w2", 0)


def test_placement_validation_and_replica_map() -> None:
    placement = identity_placement(8, 4, 2)  # rank 0: experts 0-5, rank 1: 6, 7, 0, 1, 2, 3
    assert placement.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    table, counts = replica_map(placement, 8)
    assert counts.tolist() == [2, 2, 2, 2, 1, 1, 1, 1]
    assert table[0].tolist() == [0, 8] and table[7].tolist() == [7, -1]
    with pytest.raises(ValueError, match="num_redundant_experts=2"):
        identity_placement(8, 2, 1)  # one rank cannot hold two copies of an expert
    with pytest.raises(ValueError, match="divisible"):
        identity_placement(8, 1, 2)


def test_shared_expert_overlap_flag_changes_nothing_on_cpu() -> None:
    from pagedserve.models.moe_model import SparseMoeBlock

    def build(overlap: bool) -> SparseMoeBlock:
        with use_moe_options(MoeOptions(multistream_overlap_shared_expert=overlap)):
            torch.manual_seed(5)
            block = SparseMoeBlock(HIDDEN, NUM_EXPERTS, TOP_K, INTERMEDIATE, params_dtype=torch.float32,
                                   prefix="mlp", shared_intermediate_size=16, shared_expert_name="shared_expert",
                                   has_shared_expert_gate=True, renormalize=True)
        generator = torch.Generator().manual_seed(6)
        for parameter in block.parameters():
            parameter.data.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
        return block

    plain, overlapped = build(False), build(True)
    assert overlapped.overlap.enabled and not plain.overlap.enabled
    hidden = torch.randn(33, HIDDEN)
    assert torch.equal(plain(hidden), overlapped(hidden))  # bit for bit
