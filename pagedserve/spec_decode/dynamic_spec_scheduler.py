"""Dynamic speculation for block drafters (DSpark, DFlash): per-request verify lengths from draft confidences.

A block drafter proposes K tokens per request in one forward, together with a confidence c[b, j] in (0, 1]
that draft j of request b is accepted given that drafts 0..j-1 were. Verifying all K drafts of every request
wastes target compute on drafts that will almost surely be rejected, so DynamicSpecScheduler picks how many
of each request's drafts to verify:

1. Survival: S = cumprod(clamp(c, 1e-6, 1), dim=1), the estimated chance that drafts 0..j are all accepted.
   Every factor is <= 1, so S is non-increasing along each row (also after float rounding: rounding is
   monotone and x * p <= x).
2. A batch-wide budget budget_k (verified drafts per request on average) starts at
   clamp(initial_verify_budget_per_req, min_k, K) and is re-estimated every budget_update_interval calls
   as the mean number of drafts per request whose survival reaches budget_threshold, rounded up and then
   made odd when below K (K drafts plus the bonus token give an even verify width, which kernels prefer).
3. Every request verifies min_k drafts; the B * (budget_k - min_k) remaining slots go to the largest S[b, j]
   with j >= min_k across the whole batch. Confident requests verify more, doubtful ones fewer, and the
   total stays B * budget_k.

Also here, the two drafting pieces the scheduler consumes: `markov_corrected_drafts` (DSpark's low-rank
Markov head, greedy) and `dflash_confidence` (DFlash's head-free confidence, the top softmax probability).

Everything is torch and vectorised over the batch, so it runs on any device; the only host synchronisation is
one `.item()` on budget-update calls, which keeps the other calls capturable in a device graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.config.knob_dict import config_from_dict
from pagedserve.sample.greedy import first_argmax

# The knobs' place in the engine configuration (speculative_config.dynamic_spec_config.method_params),
# used to name fields in error messages.
PARAMS_NAME = "dynamic_spec_config.method_params"
# Confidences are clamped to [MIN_CONFIDENCE, 1] before the product: a zero would make every later survival
# zero and tie them all, and the floor keeps them ordered by the confidences before it.
MIN_CONFIDENCE = 1e-6


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class DynamicSpecParams:
    """The dynamic-speculation knobs (vllm-ascend's `dynamic_spec_config.method_params`)."""

    # The verify budget (drafts per request) until the first update; clamped to [min_verify_tokens, K].
    initial_verify_budget_per_req: int = 5
    # The budget is re-estimated on every budget_update_interval-th call of verify_lengths.
    budget_update_interval: int = 16
    # A draft counts toward the budget estimate when its survival (the chance that it and every draft before
    # it are accepted) is at least this.
    budget_threshold: float = 0.3
    # Drafts every request verifies whatever its confidence. 0 is allowed: a request may then verify none of
    # its drafts (only the target's own next token is produced for it).
    min_verify_tokens: int = 1

    def __post_init__(self) -> None:
        for name in ("initial_verify_budget_per_req", "budget_update_interval"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{PARAMS_NAME}.{name}={value!r} must be an integer >= 1")
        if not _is_int(self.min_verify_tokens) or self.min_verify_tokens < 0:
            raise ValueError(f"{PARAMS_NAME}.min_verify_tokens={self.min_verify_tokens!r} must be an integer >= 0")
        # Survivals lie in (0, 1]: a threshold of 0 or below would count every draft, above 1 none.
        if not _is_number(self.budget_threshold) or not 0 < self.budget_threshold <= 1:
            raise ValueError(f"{PARAMS_NAME}.budget_threshold={self.budget_threshold!r} must be a number in (0, 1]")

    @staticmethod
    def from_dict(value: dict[str, Any] | None) -> "DynamicSpecParams":
        """From a `method_params` dict; None gives the defaults. Unknown keys are rejected by name."""
        if value is None:
            return DynamicSpecParams()
        return config_from_dict(DynamicSpecParams, PARAMS_NAME, value)


class DynamicSpecScheduler:
    """Chooses how many of each request's K drafts the target verifies, from the drafter's confidences.

    Call `verify_lengths` once per step with that step's confidences. Calls are counted from 1: on call
    number n with n % budget_update_interval == 0 (calls interval, 2 * interval, ...) the budget is first
    re-estimated from that call's confidences and that call already allocates with the new budget; every
    other call allocates with the budget as it stands.
    """

    def __init__(self, params: DynamicSpecParams, num_speculative_tokens: int) -> None:
        if not _is_int(num_speculative_tokens) or num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens!r} must be an integer >= 1")
        if params.min_verify_tokens > num_speculative_tokens:
            raise ValueError(f"{PARAMS_NAME}.min_verify_tokens={params.min_verify_tokens} must be <= "
                             f"num_speculative_tokens={num_speculative_tokens}")
        self.params = params
        self.num_speculative_tokens = num_speculative_tokens
        self.min_verify_tokens = params.min_verify_tokens
        # A host int: the allocation's number of extra slots must be known on the host (a static shape).
        self._budget_k = self._clamp_budget(params.initial_verify_budget_per_req)
        self._num_steps = 0

    @property
    def budget_k(self) -> int:
        """Verified drafts per request on average: the allocation's total is batch size * budget_k."""
        return self._budget_k

    @property
    def num_steps(self) -> int:
        """Calls of verify_lengths so far."""
        return self._num_steps

    def _clamp_budget(self, budget: int) -> int:
        return min(max(budget, self.min_verify_tokens), self.num_speculative_tokens)

    def verify_lengths(self, confidence: torch.Tensor) -> torch.Tensor:
        """[B, K] float confidences (draft j accepted given drafts before it were) -> [B] int64 verify lengths.

        Request b verifies its first len[b] drafts; min_verify_tokens <= len[b] <= K, and the lengths sum to
        B * budget_k. NaN confidences count as the lowest confidence. Runs on the confidences' device.
        """
        if confidence.dim() != 2 or confidence.shape[1] != self.num_speculative_tokens:
            raise ValueError(f"confidence has shape {tuple(confidence.shape)}; expected [batch_size, "
                             f"num_speculative_tokens={self.num_speculative_tokens}]")
        if not confidence.is_floating_point():
            raise ValueError(f"confidence has dtype {confidence.dtype}; expected a floating-point dtype")
        self._num_steps += 1
        batch_size, num_tokens = confidence.shape
        min_k = self.min_verify_tokens
        # float32 for the product: bf16 survivals would collapse into ties after a few drafts.
        probabilities = torch.nan_to_num(confidence.float(), nan=0.0).clamp(MIN_CONFIDENCE, 1.0)
        survival = torch.cumprod(probabilities, dim=1)
        # An empty batch has no mean to estimate from; its update call leaves the budget as it is.
        if self._num_steps % self.params.budget_update_interval == 0 and batch_size > 0:
            self._update_budget(survival)
        lengths = torch.full((batch_size,), min_k, dtype=torch.int64, device=confidence.device)
        num_window_tokens = num_tokens - min_k
        num_extra = batch_size * (self._budget_k - min_k)
        if num_extra == 0:
            return lengths
        if num_extra == batch_size * num_window_tokens:  # budget_k == K: every draft is verified
            return lengths + num_window_tokens
        # The slots go to the num_extra largest survivals of the window S[:, min_k:], flattened row-major.
        # A stable descending sort orders equal survivals by flat index, i.e. lower b then lower j first.
        # Within a row S is non-increasing and equal values go to the lower j first, so whenever S[b, j] is
        # chosen, every S[b, j'] with min_k <= j' < j (>= S[b, j], and before it on ties) is too: each row's
        # chosen drafts are a prefix of its window.
        window = survival[:, min_k:].reshape(-1)
        order = torch.sort(window, descending=True, stable=True).indices
        is_chosen = torch.zeros_like(window, dtype=torch.bool)
        is_chosen[order[:num_extra]] = True
        # In [min_k, K] by construction: each row's window holds K - min_k drafts.
        return lengths + is_chosen.view(batch_size, num_window_tokens).sum(dim=1)

    def _update_budget(self, survival: torch.Tensor) -> None:
        """budget_k from this call's survivals: drafts per request reaching the threshold, rounded up, made odd."""
        batch_size = survival.shape[0]
        # ceil(count / B) in integers: a float mean could round a whole number up past it.
        num_reaching = int((survival >= self.params.budget_threshold).sum().item())
        target_k = -(-num_reaching // batch_size)
        # An odd K plus the bonus token is an even verify width. 0 (no draft reaches the threshold) is even too
        # and becomes 1 before the clamp to [min_k, K].
        if target_k % 2 == 0 and target_k < self.num_speculative_tokens:
            target_k += 1
        self._budget_k = self._clamp_budget(target_k)


def markov_corrected_drafts(base_logits: torch.Tensor, seed_token_ids: torch.Tensor, w1: torch.Tensor,
                            w2: torch.Tensor, draft_id_to_target_id: torch.Tensor | None = None) -> torch.Tensor:
    """DSpark's greedy drafts: the block drafter's logits corrected position by position by a Markov head.

    base_logits [B, K, V] come from one parallel block forward, so no position sees the drafts before it. The
    low-rank head adds that dependence: position i's logits get the bias w1[d_i] @ w2, where d_i is the
    previous draft (d_0 = seed_token_ids, the target's next token), w1 [vocab, r] embeds a token into rank r and
    w2 [r, V] maps back to the (draft) vocabulary; d_{i+1} is the first argmax of the corrected logits. With a
    draft vocabulary smaller than the target's, `draft_id_to_target_id` [V] maps each argmax to its target id
    (d + map[d]), which is the draft and what w1 embeds next. Returns the drafts d_1..d_K as [B, K] int64 target
    ids. The loop over K is inherent (each draft needs the one before it).
    """
    if base_logits.dim() != 3:
        raise ValueError(f"base_logits has shape {tuple(base_logits.shape)}; expected [batch_size, "
                         f"num_speculative_tokens, vocab_size]")
    batch_size, num_tokens, vocab_size = base_logits.shape
    if seed_token_ids.shape != (batch_size,):
        raise ValueError(f"seed_token_ids has shape {tuple(seed_token_ids.shape)}; expected [{batch_size}]")
    if w1.dim() != 2 or (draft_id_to_target_id is None and w1.shape[0] != vocab_size):
        raise ValueError(f"w1 has shape {tuple(w1.shape)}; expected [vocab_size={vocab_size}, rank]")
    if w2.shape != (w1.shape[1], vocab_size):
        raise ValueError(f"w2 has shape {tuple(w2.shape)}; expected [rank={w1.shape[1]}, vocab_size={vocab_size}]")
    if draft_id_to_target_id is not None and draft_id_to_target_id.shape != (vocab_size,):
        raise ValueError(f"draft_id_to_target_id has shape {tuple(draft_id_to_target_id.shape)}; expected "
                         f"[{vocab_size}]")
    draft_ids = torch.empty((batch_size, num_tokens), dtype=torch.int64, device=base_logits.device)
    previous_ids = seed_token_ids.long()
    for position in range(num_tokens):
        # A new contiguous [B, V] tensor, as first_argmax's fast paths want.
        logits = base_logits[:, position] + (w1[previous_ids] @ w2).to(base_logits.dtype)
        previous_ids = first_argmax(logits)
        if draft_id_to_target_id is not None:
            previous_ids = previous_ids + draft_id_to_target_id[previous_ids]
        draft_ids[:, position] = previous_ids
    return draft_ids


def dflash_confidence(draft_logits: torch.Tensor) -> torch.Tensor:
    """DFlash's head-free confidence: each position's top softmax probability, [B, K, V] -> [B, K] float32."""
    # float32 softmax: in bf16 the top probability of a flat distribution loses most of its digits.
    return torch.softmax(draft_logits.float(), dim=-1).amax(dim=-1)


__all__ = ["DynamicSpecParams", "DynamicSpecScheduler", "markov_corrected_drafts", "dflash_confidence"]
