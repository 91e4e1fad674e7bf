"""HiddenStateProposer: drafts with a network over the target's hidden states (methods 'eagle', 'eagle3', 'mtp').

Each step, after the target's forward and verification:
  1. catch-up: the drafter runs over every position the target computed this step and kept (a request's
     rejected draft positions are dropped), in one forward: at position p it takes the token at p + 1 (the
     next prompt token, or the token the step emitted) and the target's hidden state at p (EAGLE-3: the
     residual stream entering three target layers, through the drafter's fc). Prefill chunks included, so the
     drafter's KV covers every position the target's does.
  2. draft 1 of each request that sampled: the argmax of the drafter's logits at its last kept position;
  3. drafts 2..k: one-token forwards at the next positions, each feeding the previous draft and the drafter's
     own hidden state from the position before.
Drafting is greedy (the argmax): the rejection sampler treats the drafts as certain (q one-hot), which keeps
sampled requests lossless (accepted with probability p(draft)). The drafter's KV at draft positions is
rewritten by the next catch-up, which covers those positions once they hold verified tokens.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.forward_context import set_forward_context
from pagedserve.models.hidden_state_drafter import HiddenStateDrafter
from pagedserve.sample.greedy import first_argmax
from pagedserve.spec_decode.draft_limits import num_drafts_allowed
from pagedserve.spec_decode.target_layer_capture import TargetLayerCapture
from pagedserve.worker.input_batch import InputBatch, StepInputs, step_over_positions


@dataclass
class TargetStep:
    """The target's forward of this step, as the drafter reads it."""

    step: StepInputs
    hidden_states: torch.Tensor  # [step tokens, hidden] the target's final hidden states


class HiddenStateProposer:
    def __init__(self, drafter: HiddenStateDrafter, target: torch.nn.Module, max_model_len: int,
                 device: torch.device) -> None:
        self.drafter = drafter
        self.max_model_len = max_model_len
        self.device = device
        layer_ids = drafter.aux_hidden_state_layer_ids
        self.capture = TargetLayerCapture(target, layer_ids, outputs=drafter.reads_layer_outputs) \
            if layer_ids else None

    def propose(self, batch: InputBatch, target: TargetStep, sampled_token_ids: list[list[int]],
                scheduled_spec_decode_tokens: dict[str, list[int]], num_speculative_tokens: int,
                build_attention_metadata: Callable[[StepInputs], AttentionMetadata]) -> list[list[int]]:
        step = target.step
        drafts: list[list[int]] = [[] for _ in step.request_ids]
        num_kept = num_kept_positions(step, sampled_token_ids, scheduled_spec_decode_tokens)
        hidden_states = self.drafter.combine_hidden_states(kept_hidden_states(target, self.capture, num_kept))
        catch_up = step_over_positions(batch, step.request_ids, step.rows, step.num_computed_before, num_kept,
                                       self.device, token_offset=1)
        output, next_hidden = self._forward(catch_up, hidden_states, 0, build_attention_metadata)

        indices, num_drafts = drafting_requests(batch, step.request_ids, sampled_token_ids, num_speculative_tokens,
                                                self.max_model_len)
        if not indices:
            return drafts
        last = torch.from_numpy(catch_up.query_start_loc[1:][indices] - 1).to(output.device)
        drafts_by_index = {i: [token] for i, token in zip(
            indices, first_argmax(self.drafter.compute_logits(output[last], 0)).tolist())}
        positions = dict(zip(indices, (catch_up.num_computed_before + num_kept - 1)[indices].tolist()))
        hidden = next_hidden[last]
        active = list(range(len(indices)))  # into indices / hidden's rows
        for j in range(1, max(num_drafts)):
            # Only requests still drafting run (the KV slots past a request's k may not be allocated).
            keep = [a for a in active if num_drafts[a] > j]
            hidden = hidden[[active.index(a) for a in keep]]
            active = keep
            request_indices = [indices[a] for a in active]
            rows = step.rows[request_indices]
            for i in request_indices:
                positions[i] += 1
                # The previous draft is the input at the new position (read from position + 1: token_offset 1).
                batch.token_ids[step.rows[i], positions[i] + 1] = drafts_by_index[i][-1]
            draft_step = step_over_positions(batch, [step.request_ids[i] for i in request_indices], rows,
                                             np.array([positions[i] for i in request_indices], dtype=np.int64),
                                             np.ones(len(active), dtype=np.int64), self.device, token_offset=1)
            output, hidden = self._forward(draft_step, hidden, j, build_attention_metadata)
            for i, token in zip(request_indices, first_argmax(self.drafter.compute_logits(output, j)).tolist()):
                drafts_by_index[i].append(token)
        for i, request_drafts in drafts_by_index.items():
            drafts[i] = request_drafts
        return drafts

    def _forward(self, step: StepInputs, hidden_states: torch.Tensor, step_index: int,
                 build_attention_metadata: Callable[[StepInputs], AttentionMetadata]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        with set_forward_context(build_attention_metadata(step)):
            return self.drafter(step.input_ids, step.positions, hidden_states, step_index)


def num_kept_positions(step: StepInputs, sampled_token_ids: list[list[int]],
                       scheduled_spec_decode_tokens: dict[str, list[int]]) -> np.ndarray:
    """Positions of each request's step that hold verified tokens: all it computed, less the rejected drafts."""
    num_kept = step.num_scheduled.copy()
    for i, request_id in enumerate(step.request_ids):
        scheduled_drafts = scheduled_spec_decode_tokens.get(request_id)
        if scheduled_drafts and sampled_token_ids[i]:
            num_kept[i] -= len(scheduled_drafts) - (len(sampled_token_ids[i]) - 1)
    return num_kept


def kept_hidden_states(target: TargetStep, capture: TargetLayerCapture | None, num_kept: np.ndarray) -> torch.Tensor:
    """The target's hidden states (or the captured layers') at the kept positions, request by request."""
    step = target.step
    token_index = np.concatenate([np.arange(start, start + count) for start, count in
                                  zip(step.query_start_loc[:-1].tolist(), num_kept.tolist())])
    hidden_states = capture.hidden_states() if capture is not None else target.hidden_states
    return hidden_states[torch.from_numpy(token_index).to(hidden_states.device)]


def drafting_requests(batch: InputBatch, request_ids: list[str], sampled_token_ids: list[list[int]],
                      num_speculative_tokens: int, max_model_len: int) -> tuple[list[int], list[int]]:
    """(indices of the requests that sampled and may draft, the number of drafts each may take)."""
    indices, num_drafts = [], []
    if num_speculative_tokens == 0:
        return indices, num_drafts
    for i, (request_id, sampled) in enumerate(zip(request_ids, sampled_token_ids)):
        state = batch.requests.get(request_id)
        if not sampled or state is None:
            continue
        k = num_drafts_allowed(state, int(batch.num_tokens[state.row]), num_speculative_tokens, max_model_len)
        if k:
            indices.append(i)
            num_drafts.append(k)
    return indices, num_drafts


__all__ = ["HiddenStateProposer", "TargetStep", "drafting_requests", "kept_hidden_states", "num_kept_positions"]
