"""DraftModelProposer: a smaller model with the target's tokenizer drafts K tokens autoregressively (vLLM's
method 'draft_model').

Its attention layers have KV caches of their own, allocated by the worker beside the target's for the same block
ids: the drafter reads and writes the request's own blocks, so the KV cache manager accounts for it, frees it on
every path, and the scheduler allocates `num_speculative_tokens` lookahead slots for the positions it drafts at.

Each propose, per request that sampled: a catch-up forward over the tokens the drafter has not seen (the whole
prompt the first time, then the tokens the last step emitted), whose last logits give draft 1, then K - 1
one-token forwards, each feeding the previous draft. Greedy requests draft the argmax; sampled requests sample
each draft from the drafter's distribution under their own temperature / top-k / top-p / min-p, with their own
generator when seeded, and keep that distribution (q) for the rejection sampler, so verification stays lossless
and a drafter equal to the target accepts everything. The drafter's KV at a position its draft went in at is that
of the token there once the draft is accepted (the same input token at the same position, after the same valid
KV), so the next catch-up starts after the accepted drafts that went in: at high acceptance it runs over the last
token or two instead of every token the verification emitted. From the first rejected draft on, the catch-up
recomputes.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.forward_context import set_forward_context
from pagedserve.sample.greedy import first_argmax
from pagedserve.sample.sampler import Sampler, random_sample
from pagedserve.sample.sampling_metadata import build_sampling_metadata
from pagedserve.sampling_params import SamplingType
from pagedserve.spec_decode.draft_limits import num_drafts_allowed
from pagedserve.worker.input_batch import InputBatch, RequestState, StepInputs, as_decode_rows, step_over_positions


@dataclass
class Drafts:
    """token_ids[i]: request i's drafts; probs[request id]: [num drafts, vocab] q of its sampled drafts."""

    token_ids: list[list[int]]
    probs: dict[str, torch.Tensor]


class DraftModelProposer:
    def __init__(self, draft_model: nn.Module, vocab_size: int, max_model_len: int, max_num_batched_tokens: int,
                 device: torch.device, greedy_drafting: bool = False,
                 forward: Callable[..., torch.Tensor] | None = None, max_decode_rows: int = 0) -> None:
        """`greedy_drafting` (draft_sample_method 'greedy'): every request drafts the drafter's argmax. `forward`:
        the drafter's forward (the runner may give a native decode stack over it; default the module itself);
        forwards whose every request runs at most `max_decode_rows` tokens (the catch-up after a verification)
        take it as decode rows, as the target's verifications do."""
        self.model = draft_model
        self.forward = forward if forward is not None else draft_model
        self.max_decode_rows = max_decode_rows
        self.greedy_drafting = greedy_drafting
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # The catch-up runs in forwards of at most this many tokens, like the target's prefill chunks.
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = device
        self.sampler = Sampler()
        # request id -> (the batch's state object, positions whose drafter KV held known tokens at the last propose,
        # the drafts it made then). A new state object (the request was preempted and came back, or the id was
        # reused) starts from 0 again.
        self._num_computed: dict[str, tuple[RequestState, int, list[int]]] = {}

    def propose(self, batch: InputBatch, request_ids: list[str], sampled_token_ids: list[list[int]],
                num_speculative_tokens: int, generators: dict[str, torch.Generator],
                build_attention_metadata: Callable[[StepInputs], AttentionMetadata]) -> Drafts:
        drafts = Drafts(token_ids=[[] for _ in request_ids], probs={})
        self._forget_departed(batch)
        indices, states, num_known, num_drafts = [], [], [], []
        for i, (request_id, sampled) in enumerate(zip(request_ids, sampled_token_ids)):
            state = batch.requests.get(request_id)
            if not sampled or state is None:
                continue
            known = int(batch.num_tokens[state.row])
            k = num_drafts_allowed(state, known, num_speculative_tokens, self.max_model_len)
            if k == 0:
                continue
            indices.append(i)
            states.append(state)
            num_known.append(known)
            num_drafts.append(k)
        if not states:
            return drafts
        metadata = build_sampling_metadata(
            params=[s.sampling_params for s in states], prompt_token_ids=[[] for _ in states],
            output_token_ids=[[] for _ in states], generators=[generators.get(s.request_id) for s in states],
            vocab_size=self.vocab_size, device=self.device)
        is_sampled = [not self.greedy_drafting and s.sampling_params.sampling_type != SamplingType.GREEDY
                      for s in states]

        # Catch-up: every known token the drafter has not computed; draft 1 from the last one.
        starts = [self._start(batch, state, known) for state, known in zip(states, num_known)]
        self._catch_up(batch, states, starts, num_known, build_attention_metadata)
        logits = self._forward(batch, states, starts, num_known, build_attention_metadata)
        tokens, probs = self._draft(logits, metadata, is_sampled)
        columns_tokens, columns_probs = [tokens], [probs]
        for j in range(1, max(num_drafts)):
            active = [b for b, k in enumerate(num_drafts) if k > j]
            positions = [num_known[b] + j - 1 for b in active]
            # The previous draft goes in at its position (after the known tokens, where verification puts it too).
            for b, position in zip(active, positions):
                batch.token_ids[states[b].row, position] = columns_tokens[-1][b]
            logits_active = self._forward(batch, [states[b] for b in active], positions,
                                          [p + 1 for p in positions], build_attention_metadata)
            logits = torch.empty((len(states), logits_active.shape[1]), dtype=logits_active.dtype,
                                 device=logits_active.device)
            logits[active] = logits_active
            tokens, probs = self._draft(logits, metadata, is_sampled, rows=active)
            columns_tokens.append(tokens)
            columns_probs.append(probs)
        for b, (i, state, k) in enumerate(zip(indices, states, num_drafts)):
            drafts.token_ids[i] = [int(column[b]) for column in columns_tokens[:k]]
            if is_sampled[b]:
                drafts.probs[state.request_id] = torch.stack([column[b] for column in columns_probs[:k]])
            self._num_computed[state.request_id] = (state, num_known[b], drafts.token_ids[i])
        return drafts

    def _catch_up(self, batch: InputBatch, states: list[RequestState], starts: list[int], num_known: list[int],
                  build_attention_metadata: Callable[[StepInputs], AttentionMetadata]) -> None:
        """Forwards over the tokens before each request's last known one, in rounds of at most
        max_num_batched_tokens tokens, until the rest fits in one forward (advances `starts`)."""
        while sum(known - start for known, start in zip(num_known, starts)) > self.max_num_batched_tokens:
            lagging = [b for b, (known, start) in enumerate(zip(num_known, starts)) if known - 1 > start]
            if not lagging:
                return  # one token per request left: more requests than the budget, run them together
            cap = max(1, self.max_num_batched_tokens // len(lagging))
            ends = [min(starts[b] + cap, num_known[b] - 1) for b in lagging]
            self._forward(batch, [states[b] for b in lagging], [starts[b] for b in lagging], ends,
                          build_attention_metadata, with_logits=False)
            for b, end in zip(lagging, ends):
                starts[b] = end

    def _start(self, batch: InputBatch, state: RequestState, known: int) -> int:
        """The first position of the catch-up: after the positions the drafter computed from known tokens, and after
        those its drafts went in at (drafts 1 .. k - 1, from the last known position on) while the tokens there are
        the drafts; at most known - 1, so that the forward also gives the next draft's logits."""
        seen = self._num_computed.get(state.request_id)
        if seen is None or seen[0] is not state:
            return 0
        _, start, previous_drafts = seen
        for draft in previous_drafts[:-1]:  # the last draft never went in
            if start >= known - 1 or int(batch.token_ids[state.row, start]) != draft:
                break
            start += 1
        return start

    def _forget_departed(self, batch: InputBatch) -> None:
        for request_id in [rid for rid in self._num_computed if rid not in batch.requests]:
            del self._num_computed[request_id]

    def _forward(self, batch: InputBatch, states: list[RequestState], starts: list[int], ends: list[int],
                 build_attention_metadata: Callable[[StepInputs], AttentionMetadata],
                 with_logits: bool = True) -> torch.Tensor | None:
        """The drafter over positions [starts[b], ends[b]) of each request; logits at each one's last position."""
        rows = np.array([s.row for s in states], dtype=np.int64)
        computed = np.array(starts, dtype=np.int64)
        step = step_over_positions(batch, [s.request_id for s in states], rows, computed,
                                   np.array(ends, dtype=np.int64) - computed, self.device)
        attention_step = as_decode_rows(step) if int(step.num_scheduled.max()) <= self.max_decode_rows else step
        with set_forward_context(build_attention_metadata(attention_step)):
            hidden_states = self.forward(step.input_ids, step.positions)
        if not with_logits:
            return None
        last = torch.from_numpy(step.query_start_loc[1:] - 1).to(hidden_states.device)
        return self.model.compute_logits(hidden_states[last])

    def _draft(self, logits: torch.Tensor, metadata, is_sampled: list[bool],  # type: ignore[no-untyped-def]
               rows: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
        """One draft per row (argmax, or a sample from the processed distribution) and that distribution q
        ([rows, vocab] float32; only the sampled rows' are used). Rows outside `rows` draw nothing."""
        rows = list(range(len(is_sampled))) if rows is None else rows
        logits = logits.to(torch.float32)
        tokens = first_argmax(logits).tolist()
        probs = torch.zeros_like(logits)
        sampled_rows = [b for b in rows if is_sampled[b]]
        if sampled_rows:
            processed = self.sampler.processed_logits(logits, metadata)
            probs[sampled_rows] = processed[sampled_rows].softmax(dim=-1)
            # The exponential race draws from each seeded row's generator (and the global RNG for the others).
            noise_probs = probs.clone()
            drawn = random_sample(noise_probs, _restricted(metadata, sampled_rows)).tolist()
            for b in sampled_rows:
                tokens[b] = drawn[b]
        return tokens, probs


def _restricted(metadata, rows: list[int]):  # type: ignore[no-untyped-def]
    """The metadata with generators for `rows` only, so rows that draw nothing do not advance theirs."""
    from dataclasses import replace

    return replace(metadata, generators={row: g for row, g in metadata.generators.items() if row in rows})
