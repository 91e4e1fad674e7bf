"""Speculator: the model runner's speculative-decoding seam.

The runner calls three things, and carries nothing else of speculation:
  write_drafts  puts the drafts the scheduler scheduled after each request's known tokens in the persistent
                batch (the step's input ids for those positions are read from there);
  verify        scores every draft position of the step at once: logits at the last known position and at
                each draft, processed as the sampler would (penalties with the drafts before them counted,
                temperature, truncation), the rejection sampler's accepted drafts plus one token of the
                target's own, written back to the batch, with logprobs of the emitted tokens (a step whose
                requests are all plain greedy takes the argmax and the greedy rule directly);
  observe_forward  keeps the target's step inputs and hidden states for drafters that read them;
  propose       drafts the next step's tokens for every request that sampled this step.
The scheduler learns the drafts from ModelRunnerOutput.spec_token_ids, schedules them after the known tokens,
and rolls num_computed_tokens back past the rejected ones (core/scheduler.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedserve.config.speculative import BLOCK_DRAFT_METHODS, HIDDEN_STATE_METHODS, SpeculativeConfig
from pagedserve.core.scheduler_output import GrammarBitmask, LogprobsLists
from pagedserve.sample.fused_greedy_head import head_first_argmax
from pagedserve.sample.greedy import first_argmax
from pagedserve.sample.logprobs import compute_logprobs, gather_logprobs
from pagedserve.sample.sampler import Sampler
from pagedserve.sample.sampling_metadata import build_sampling_metadata, has_penalty
from pagedserve.sampling_params import SamplingParams, SamplingType
from pagedserve.spec_decode.block_draft_proposer import BlockDraftProposer
from pagedserve.structured_output.logits_mask import apply_grammar_bitmask
from pagedserve.spec_decode.draft_model_proposer import DraftModelProposer
from pagedserve.spec_decode.hidden_state_proposer import HiddenStateProposer, TargetStep
from pagedserve.spec_decode.ngram_proposer import NgramProposer
from pagedserve.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from pagedserve.worker.input_batch import InputBatch, RequestState, StepInputs

if TYPE_CHECKING:
    from torch import nn

    from pagedserve.attention.backend import AttentionMetadata


def _is_plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing that reads the logits beyond their argmax (no logprobs, penalties or min_tokens)."""
    return params.sampling_type == SamplingType.GREEDY and params.logprobs is None and params.min_tokens == 0 \
        and not has_penalty(params)


@dataclass
class VerifiedTokens:
    """Per sampled request of a step: its emitted tokens (accepted drafts + one), and logprobs when asked."""

    request_indices: list[int]  # indices into the step's request_ids
    token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)


@dataclass
class ScoredPositions:
    """A verification step's sampled requests and the positions it scores: each request's last len(drafts) + 1
    tokens of the step, in order."""

    request_indices: list[int]  # indices into the step's request_ids
    states: list[RequestState]
    draft_lists: list[list[int]]  # each request's scheduled drafts
    offsets: np.ndarray  # [B + 1]: request b's positions are [offsets[b], offsets[b + 1])
    position_requests: np.ndarray  # per position: its request (0 .. B - 1)
    within: np.ndarray  # per position: its index within its request's positions
    token_rows: np.ndarray  # per position: its row among the step's tokens (hidden states, logits)


class Speculator:
    def __init__(self, config: SpeculativeConfig, vocab_size: int, max_model_len: int, max_num_batched_tokens: int,
                 block_size: int, device: torch.device,
                 draft_model: "nn.Module | None" = None,
                 build_attention_metadata: "Callable[[StepInputs], AttentionMetadata] | None" = None,
                 target_model: "nn.Module | None" = None,
                 build_decode_forward: "Callable[[nn.Module], Callable[..., torch.Tensor]] | None" = None) -> None:
        """`draft_model` (methods with a drafter network): the loaded drafter, whose attention layers the runner
        binds to KV caches of their own; `build_attention_metadata` builds its forwards' metadata as the runner's;
        `target_model`: the target (its LM head takes greedy verification's argmax; EAGLE-3, DFlash and DSpark
        drafters read its inner layers); `build_decode_forward`: the runner's decode-stack forward for a model,
        which a draft model's short forwards take."""
        self.config = config
        self.vocab_size = vocab_size
        self.device = device
        self.target_model = target_model
        self.ngram_proposer: NgramProposer | None = None
        self.draft_proposer: DraftModelProposer | None = None
        self.hidden_state_proposer: HiddenStateProposer | BlockDraftProposer | None = None
        # The target's last forward, for drafters that read its hidden states (observe_forward).
        self._target_step: TargetStep | None = None
        if config.method in ("draft_model", *HIDDEN_STATE_METHODS) and \
                (draft_model is None or build_attention_metadata is None):
            raise ValueError(f"speculative_config.method={config.method!r} needs the loaded drafter")
        self.build_attention_metadata = build_attention_metadata
        if config.method == "ngram":
            assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
            self.ngram_proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        elif config.method == "draft_model":
            forward = build_decode_forward(draft_model) if build_decode_forward is not None else None
            self.draft_proposer = DraftModelProposer(draft_model, vocab_size, max_model_len, max_num_batched_tokens,
                                                     device, greedy_drafting=config.draft_sample_method == "greedy",
                                                     forward=forward,
                                                     max_decode_rows=1 + (config.num_speculative_tokens or 0))
        elif config.method in BLOCK_DRAFT_METHODS:
            assert target_model is not None
            dynamic = config.dynamic_spec_config
            scheduler = None
            if dynamic is not None:
                from pagedserve.spec_decode.dynamic_spec_scheduler import DynamicSpecScheduler

                scheduler = DynamicSpecScheduler(dynamic.method_params, config.num_speculative_tokens)
            self.hidden_state_proposer = BlockDraftProposer(draft_model, target_model, max_model_len, block_size,
                                                            device, scheduler,
                                                            dynamic.method if dynamic is not None else None)
        elif config.method in HIDDEN_STATE_METHODS:
            assert target_model is not None
            self.hidden_state_proposer = HiddenStateProposer(draft_model, target_model, max_model_len, device)
        else:
            raise ValueError(f"speculative_config.method={config.method!r} has no proposer in this build")
        # request id -> [num drafts, vocab] distributions of its last sampled drafts (draft_model only).
        self._draft_probs: dict[str, torch.Tensor] = {}
        verify = config.rejection_sampler_config
        self.rejection_sampler = RejectionSampler(
            enable_block_verify=verify.enable_block_verify, enable_entropy_verify=verify.enable_entropy_verify,
            posterior_threshold=verify.posterior_threshold, posterior_alpha=verify.posterior_alpha)
        self.sampler = Sampler()

    # ---- before the forward -----------------------------------------------------------------------
    @staticmethod
    def write_drafts(batch: InputBatch, scheduled_spec_decode_tokens: dict[str, list[int]]) -> None:
        """Drafts go right after each request's known tokens (not counted in num_tokens until accepted)."""
        for request_id, draft_token_ids in scheduled_spec_decode_tokens.items():
            row = batch.requests[request_id].row
            start = int(batch.num_tokens[row])
            batch.token_ids[row, start:start + len(draft_token_ids)] = draft_token_ids

    # ---- after the forward ------------------------------------------------------------------------
    def verify(self, step: StepInputs, hidden_states: torch.Tensor, batch: InputBatch,
               scheduled_spec_decode_tokens: dict[str, list[int]], generators: dict[str, torch.Generator],
               compute_logits: Callable[[torch.Tensor], torch.Tensor],
               grammar_bitmask: GrammarBitmask | None = None) -> VerifiedTokens:
        """Verify the step's drafts and append what is emitted to the batch (see the module docstring).

        `grammar_bitmask` (structured outputs): the constrained requests' allowed tokens at each scored position;
        their logits are masked before verification, so a draft the grammar forbids is rejected and the token
        emitted in its place is one the grammar allows."""
        positions = self._scored_positions(step, batch, scheduled_spec_decode_tokens)
        request_indices, states, draft_lists, offsets = \
            positions.request_indices, positions.states, positions.draft_lists, positions.offsets
        position_requests, within = positions.position_requests, positions.within
        num_drafts = np.diff(offsets) - 1
        scored = hidden_states[torch.from_numpy(positions.token_rows).to(hidden_states.device)]
        masked_logits = None
        if grammar_bitmask is not None:
            masked_logits = compute_logits(scored)
            apply_grammar_bitmask(masked_logits, grammar_bitmask,
                                  [states[b].request_id for b in position_requests.tolist()], within.tolist())
        if all(_is_plain_greedy(state.sampling_params) for state in states):
            token_ids = self._verify_greedy(scored, compute_logits, draft_lists, offsets, masked_logits)
            for state, emitted in zip(states, token_ids):
                batch.extend_tokens(state.row, int(batch.num_tokens[state.row]), emitted)
            return VerifiedTokens(request_indices=request_indices, token_ids=token_ids)
        logits = compute_logits(scored) if masked_logits is None else masked_logits

        processed = self.sampler.processed_logits(logits, self._position_metadata(states, draft_lists, batch,
                                                                                   generators))
        max_num_drafts = int(num_drafts.max()) if len(num_drafts) else 0
        # [B, K + 1] flat row of each (request, position); positions past a request's drafts repeat its last.
        grid = offsets[:-1, None] + np.minimum(np.arange(max_num_drafts + 1)[None, :], num_drafts[:, None])
        grid_index = torch.from_numpy(grid).to(logits.device)
        draft_token_ids = torch.full((len(states), max_num_drafts), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
        for b, drafts in enumerate(draft_lists):
            draft_token_ids[b, :len(drafts)] = torch.tensor(drafts, dtype=torch.int64)
        is_greedy = torch.tensor([state.sampling_params.sampling_type == SamplingType.GREEDY for state in states],
                                 dtype=torch.bool)
        row_generators = {b: generators[state.request_id] for b, state in enumerate(states)
                          if state.request_id in generators and not bool(is_greedy[b])}
        # Entropy verify measures the target's uncertainty before temperature and truncation.
        raw_logits = logits.to(torch.float32)[grid_index] \
            if self.config.rejection_sampler_config.enable_entropy_verify else None
        result = self.rejection_sampler(
            draft_token_ids=draft_token_ids.to(logits.device), num_draft_tokens=num_drafts.tolist(),
            target_logits=processed[grid_index], draft_probs=self._take_draft_probs(states, max_num_drafts),
            is_greedy=is_greedy.to(logits.device),
            generators=row_generators, raw_target_logits=raw_logits)
        output_rows = result.output_token_ids.tolist()
        token_ids = [output_rows[b][:num_accepted + 1] for b, num_accepted in enumerate(result.num_accepted_tokens)]
        for state, emitted in zip(states, token_ids):
            batch.extend_tokens(state.row, int(batch.num_tokens[state.row]), emitted)
        verified = VerifiedTokens(request_indices=request_indices, token_ids=token_ids)
        self._add_logprobs(verified, states, logits, offsets, token_ids)
        return verified

    @staticmethod
    def _scored_positions(step: StepInputs, batch: InputBatch,
                          scheduled_spec_decode_tokens: dict[str, list[int]]) -> ScoredPositions:
        """The step's sampled requests and their scored positions: each request's last len(drafts) + 1 tokens of
        the step, in order."""
        request_indices = step.is_sampled.nonzero()[0].tolist()
        states = [batch.requests[step.request_ids[i]] for i in request_indices]
        draft_lists = [scheduled_spec_decode_tokens.get(state.request_id, []) for state in states]
        num_positions = np.array([len(drafts) + 1 for drafts in draft_lists], dtype=np.int64)
        ends = step.query_start_loc[1:][request_indices]
        offsets = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(num_positions, out=offsets[1:])
        position_requests = np.repeat(np.arange(len(states)), num_positions)
        within = np.arange(int(offsets[-1])) - offsets[:-1][position_requests]
        token_rows = ends[position_requests] - num_positions[position_requests] + within
        return ScoredPositions(request_indices, states, draft_lists, offsets, position_requests, within, token_rows)

    def can_verify_from_targets(self, step: StepInputs, batch: InputBatch) -> bool:
        """Whether verify_targets can take this step: every sampled request is plain greedy and no drafter reads
        the target's hidden states (observe_forward), so the target's argmax at each position is all it needs."""
        return self.hidden_state_proposer is None and all(
            _is_plain_greedy(batch.requests[step.request_ids[i]].sampling_params)
            for i in step.is_sampled.nonzero()[0].tolist())

    def verify_targets(self, step: StepInputs, target_ids: torch.Tensor, batch: InputBatch,
                       scheduled_spec_decode_tokens: dict[str, list[int]]) -> VerifiedTokens:
        """verify's greedy rule from the target's argmax at every token of the step ([num tokens], e.g. the
        native decode stack's head; can_verify_from_targets held): the same tokens verify emits and appends."""
        positions = self._scored_positions(step, batch, scheduled_spec_decode_tokens)
        token_ids = self._accept_greedy(target_ids[torch.from_numpy(positions.token_rows)].tolist(),
                                        positions.draft_lists, positions.offsets)
        for state, emitted in zip(positions.states, token_ids):
            batch.extend_tokens(state.row, int(batch.num_tokens[state.row]), emitted)
        return VerifiedTokens(request_indices=positions.request_indices, token_ids=token_ids)

    def _verify_greedy(self, scored: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                       draft_lists: list[list[int]], offsets: np.ndarray,
                       logits: torch.Tensor | None = None) -> list[list[int]]:
        """Greedy verification when every request samples greedily and asks for nothing else: the target's argmax
        at each scored position (the sampler's pick; fused into the LM head where it can be), then _accept_greedy.
        `logits`: the scored positions' logits when already computed (masked by a grammar)."""
        if logits is not None:
            targets = first_argmax(logits)
        else:
            lm_head = getattr(self.target_model, "lm_head", None)
            targets = None if lm_head is None else head_first_argmax(lm_head, scored)
            if targets is None:
                targets = first_argmax(compute_logits(scored))
        return self._accept_greedy(targets.tolist(), draft_lists, offsets)

    @staticmethod
    def _accept_greedy(target_ids: list[int], draft_lists: list[list[int]], offsets: np.ndarray) -> list[list[int]]:
        """Each request's drafts accepted while they equal the target's argmax at their position, then the argmax
        where they stop (the rejection sampler's greedy rule). target_ids: the argmax at every scored position."""
        token_ids = []
        for start, drafts in zip(offsets[:-1].tolist(), draft_lists):
            num_accepted = 0
            while num_accepted < len(drafts) and drafts[num_accepted] == target_ids[start + num_accepted]:
                num_accepted += 1
            token_ids.append(drafts[:num_accepted] + [target_ids[start + num_accepted]])
        return token_ids

    def _take_draft_probs(self, states: list[RequestState], max_num_drafts: int) -> torch.Tensor | None:
        """[B, K, V] q of the rows' drafts (the drafts a step verifies may be fewer than those proposed), or None
        when no row's drafts were sampled (one-hot q: ngram, greedy drafting). Rows without theirs hold zeros:
        greedy rows never read them."""
        probs = [self._draft_probs.pop(state.request_id, None) for state in states]
        if all(p is None for p in probs):
            return None
        stacked = torch.zeros((len(states), max_num_drafts, self.vocab_size), dtype=torch.float32,
                              device=self.device)
        for b, row_probs in enumerate(probs):
            if row_probs is not None:
                count = min(max_num_drafts, row_probs.shape[0])
                stacked[b, :count] = row_probs[:count]
        return stacked

    def _position_metadata(self, states: list[RequestState], draft_lists: list[list[int]], batch: InputBatch,
                           generators: dict[str, torch.Generator]):  # type: ignore[no-untyped-def]
        """Sampling metadata with one row per scored position: position j of a request sees its outputs plus
        its first j drafts (penalties and min_tokens count them, as they would had the drafts been sampled)."""
        params, prompts, outputs, row_generators = [], [], [], []
        for state, drafts in zip(states, draft_lists):
            sampling_params = state.sampling_params
            needs_outputs = sampling_params.min_tokens > 0 or has_penalty(sampling_params)
            prompt = batch.prompt_token_ids(state) if sampling_params.repetition_penalty != 1.0 else []
            generated = batch.output_token_ids(state) if needs_outputs else []
            for j in range(len(drafts) + 1):
                params.append(sampling_params)
                prompts.append(prompt)
                outputs.append(generated + drafts[:j] if needs_outputs else [])
                row_generators.append(generators.get(state.request_id))
        return build_sampling_metadata(params=params, prompt_token_ids=prompts, output_token_ids=outputs,
                                       generators=row_generators, vocab_size=self.vocab_size, device=self.device)

    @staticmethod
    def _add_logprobs(verified: VerifiedTokens, states: list[RequestState], logits: torch.Tensor,
                      offsets: np.ndarray, token_ids: list[list[int]]) -> None:
        """Raw logprobs (vLLM's default) of each emitted token at the position that scored it."""
        wanted = [(b, state) for b, state in enumerate(states) if state.sampling_params.logprobs is not None]
        if not wanted:
            return
        rows = [int(offsets[b]) + j for b, _ in wanted for j in range(len(token_ids[b]))]
        tokens = [token for b, _ in wanted for token in token_ids[b]]
        max_num_logprobs = max(state.sampling_params.logprobs for _, state in wanted)
        row_index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        everything = gather_logprobs(compute_logprobs(logits[row_index]), torch.tensor(tokens, device=logits.device),
                                     max_num_logprobs).to_lists()
        start = 0
        for b, state in wanted:
            count = len(token_ids[b])
            width = state.sampling_params.logprobs + 1
            verified.logprobs[state.request_id] = LogprobsLists(
                logprob_token_ids=[ids[:width] for ids in everything.logprob_token_ids[start:start + count]],
                logprobs=[values[:width] for values in everything.logprobs[start:start + count]],
                sampled_token_ranks=everything.sampled_token_ranks[start:start + count])
            start += count

    # ---- the next step's drafts -------------------------------------------------------------------
    def observe_forward(self, step: StepInputs, hidden_states: torch.Tensor) -> None:
        """The target's forward of this step (its inputs and final hidden states), kept for propose."""
        if self.hidden_state_proposer is not None:
            self._target_step = TargetStep(step=step, hidden_states=hidden_states)

    def propose(self, batch: InputBatch, request_ids: list[str], sampled_token_ids: list[list[int]],
                generators: dict[str, torch.Generator],
                scheduled_spec_decode_tokens: dict[str, list[int]]) -> list[list[int]]:
        """Drafts for each request that sampled this step ([] for the others), K from the batch-size table."""
        num_speculative_tokens = self.config.num_tokens_for_batch_size(len(request_ids))
        if self.hidden_state_proposer is not None:
            # The drafter runs over every step (also when K is 0), so its KV covers every position.
            target, self._target_step = self._target_step, None
            assert target is not None and target.step.request_ids == request_ids, "observe_forward before propose"
            return self.hidden_state_proposer.propose(batch, target, sampled_token_ids, scheduled_spec_decode_tokens,
                                                      num_speculative_tokens, self.build_attention_metadata)
        drafts: list[list[int]] = [[] for _ in request_ids]
        # Distributions of drafts still waiting to be verified stay (a request the budget skipped keeps its
        # drafts); those of departed requests and of requests drafting anew go.
        for request_id in list(self._draft_probs):
            if request_id not in batch.requests:
                del self._draft_probs[request_id]
        for request_id, sampled in zip(request_ids, sampled_token_ids):
            if sampled:
                self._draft_probs.pop(request_id, None)
        if num_speculative_tokens == 0:
            return drafts
        if self.draft_proposer is not None:
            proposed = self.draft_proposer.propose(batch, request_ids, sampled_token_ids, num_speculative_tokens,
                                                   generators, self.build_attention_metadata)
            self._draft_probs.update(proposed.probs)
            return proposed.token_ids
        assert self.ngram_proposer is not None
        for i, (request_id, sampled) in enumerate(zip(request_ids, sampled_token_ids)):
            state = batch.requests.get(request_id)
            if not sampled or state is None:
                continue
            tokens = batch.token_ids[state.row, :int(batch.num_tokens[state.row])]
            drafts[i] = self.ngram_proposer.propose_one(tokens, num_speculative_tokens).tolist()
        return drafts
