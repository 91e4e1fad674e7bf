"""Expert selection (routing): router logits -> (top-k weights, top-k logical expert ids).

One function covers the families served here:
- softmax top-k, optionally renormalised over the chosen k (Mixtral, Qwen2/3-MoE);
- DeepSeek-V2 group-limited greedy: softmax scores, groups ranked by their best score, top-k inside the
  best `topk_group` groups, no renormalisation;
- DeepSeek-V3 / GLM-4.5 "noaux_tc": sigmoid scores plus `e_score_correction_bias` for the *choice* only,
  groups ranked by the sum of their two best biased scores; the weights are the unbiased scores of the
  chosen experts, optionally renormalised;
and every family scales the weights by `routed_scaling_factor` (1.0 when it has none).
Scores are computed in float32 whatever the activation dtype, as HF does.
"""
from __future__ import annotations

import torch

SCORING_FUNCTIONS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2_sum")


def select_experts(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    *,
    scoring_func: str = "softmax",
    renormalize: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    group_score: str = "max",
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (topk_weights float32 [num_tokens, top_k], topk_ids int64 [num_tokens, top_k])."""
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, {num_experts}] (the number of experts)")
    if scoring_func not in SCORING_FUNCTIONS:
        raise ValueError(f"scoring_func={scoring_func!r} must be one of {list(SCORING_FUNCTIONS)}")
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if scoring_func == "softmax" else logits.sigmoid()
    choice_scores = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if num_expert_group is not None and num_expert_group > 1:
        choice_scores = _mask_to_best_groups(choice_scores, num_expert_group, topk_group or num_expert_group,
                                             group_score)
    if e_score_correction_bias is None and not (num_expert_group and num_expert_group > 1):
        topk_weights, topk_ids = torch.topk(scores, top_k, dim=-1)
    else:
        topk_ids = torch.topk(choice_scores, top_k, dim=-1)[1]
        topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        # The small epsilon only matters for sigmoid scores that are all ~0 (HF adds it there too).
        denominator = topk_weights.sum(dim=-1, keepdim=True)
        if scoring_func == "sigmoid":
            denominator = denominator + 1e-20
        topk_weights = topk_weights / denominator
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids


def _mask_to_best_groups(choice_scores: torch.Tensor, num_groups: int, topk_group: int,
                         group_score: str) -> torch.Tensor:
    """Experts outside the `topk_group` best groups get -inf (so top-k never picks them)."""
    num_tokens, num_experts = choice_scores.shape
    if num_experts % num_groups != 0:
        raise ValueError(f"n_group={num_groups} must divide the number of experts {num_experts}")
    if not 1 <= topk_group <= num_groups:
        raise ValueError(f"topk_group={topk_group} must be in [1, {num_groups}] (n_group)")
    grouped = choice_scores.view(num_tokens, num_groups, num_experts // num_groups)
    if group_score == "max":
        group_scores = grouped.max(dim=-1).values
    elif group_score == "top2_sum":
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
    else:
        raise ValueError(f"group_score={group_score!r} must be one of {list(GROUP_SCORES)}")
    best_groups = torch.topk(group_scores, topk_group, dim=-1)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    return choice_scores.masked_fill(~expert_mask, float("-inf"))
