"""BlockDraftProposer: drafts a whole block per request in one forward (methods 'dflash' and 'dspark').

Each step, after the target's forward and verification:
  1. context: the outputs of the drafter's target layers at every position the target computed and kept (prefill
     chunks included; rejected draft positions dropped) become, through the drafter's fc and hidden_norm, K and V
     in every drafter layer's cache at those positions' slots. They depend only on the target's hidden state at
     the position, so a prefix-cache hit shares them with the blocks.
  2. drafting: for each request that sampled, one block forward over the anchor (its newest token) and mask
     tokens at the positions that follow, attending its context and its whole block (non-causal);
       dflash   [anchor, mask x K]: row j predicts the token at its own position; greedy argmax; confidence of
                each draft = its top softmax probability;
       dspark   [anchor, mask x (K - 1)] (sample_from_anchor; else as dflash): row i predicts the token after
                it; the Markov head corrects the rows left to right from the anchor (greedy, the only drafting
                DSpark supports); confidence from its confidence head.
  3. with dynamic_spec_config, DynamicSpecScheduler turns the confidences into each request's verify length and
     the drafts are cut to it (the rest of the engine sees fewer drafts).
The drafts are certain (q one-hot) for the rejection sampler, which keeps sampled requests lossless.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.forward_context import set_forward_context
from pagedserve.layers.block_draft_attention import BlockDraftMetadata
from pagedserve.models.qwen3_dflash import DFlashQwen3ForCausalLM
from pagedserve.models.qwen3_dspark import DSparkQwen3ForCausalLM
from pagedserve.sample.greedy import first_argmax
from pagedserve.spec_decode.dynamic_spec_scheduler import (DynamicSpecScheduler, dflash_confidence,
                                                           markov_corrected_drafts)
from pagedserve.spec_decode.hidden_state_proposer import (TargetStep, drafting_requests, kept_hidden_states,
                                                          num_kept_positions)
from pagedserve.spec_decode.target_layer_capture import TargetLayerCapture
from pagedserve.worker.input_batch import InputBatch, StepInputs, step_over_positions


class BlockDraftProposer:
    def __init__(self, drafter: DFlashQwen3ForCausalLM, target: torch.nn.Module, max_model_len: int, block_size: int,
                 device: torch.device, dynamic_scheduler: DynamicSpecScheduler | None = None,
                 confidence_method: str | None = None) -> None:
        """`confidence_method` ('dspark': the drafter's confidence head; 'dflash': the top softmax probability)
        feeds `dynamic_scheduler`, which sets per-request verify lengths; both None: every draft is verified."""
        self.drafter = drafter
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        self.is_dspark = isinstance(drafter, DSparkQwen3ForCausalLM)
        if confidence_method == "dspark" and not (self.is_dspark and drafter.has_confidence_head):
            raise ValueError("dynamic_spec_config.method='dspark' reads the DSpark drafter's confidence head, which "
                             "this drafter checkpoint lacks (confidence_head.proj.*, enable_confidence_head): use "
                             "dynamic_spec_config.method='dflash' (top-probability confidence) instead")
        self.dynamic_scheduler = dynamic_scheduler
        self.confidence_method = confidence_method
        self.capture = TargetLayerCapture(target, drafter.aux_hidden_state_layer_ids, outputs=True)

    def propose(self, batch: InputBatch, target: TargetStep, sampled_token_ids: list[list[int]],
                scheduled_spec_decode_tokens: dict[str, list[int]], num_speculative_tokens: int,
                build_attention_metadata: Callable[[StepInputs], AttentionMetadata]) -> list[list[int]]:
        step = target.step
        num_kept = num_kept_positions(step, sampled_token_ids, scheduled_spec_decode_tokens)
        context = step_over_positions(batch, step.request_ids, step.rows, step.num_computed_before, num_kept,
                                      self.device)
        slot_mapping = build_attention_metadata(context).slot_mapping
        self.drafter.write_context(self.drafter.combine_hidden_states(kept_hidden_states(target, self.capture,
                                                                                         num_kept)),
                                   context.positions, slot_mapping)

        drafts: list[list[int]] = [[] for _ in step.request_ids]
        indices, num_drafts = drafting_requests(batch, step.request_ids, sampled_token_ids, num_speculative_tokens,
                                                self.max_model_len)
        if not indices:
            return drafts
        rows = step.rows[indices]
        anchor_positions = batch.num_tokens[rows].astype(np.int64) - 1
        anchors = torch.from_numpy(batch.token_ids[rows, anchor_positions].copy()).to(self.device)
        draft_ids, confidence = self._draft_block(batch, rows, anchor_positions, anchors, num_speculative_tokens)
        lengths = [num_speculative_tokens] * len(indices)
        if self.dynamic_scheduler is not None:
            assert confidence is not None
            lengths = self.dynamic_scheduler.verify_lengths(confidence).tolist()
        for b, (i, k) in enumerate(zip(indices, num_drafts)):
            drafts[i] = draft_ids[b, :min(k, lengths[b])].tolist()
        return drafts

    def _draft_block(self, batch: InputBatch, rows: np.ndarray, anchor_positions: np.ndarray, anchors: torch.Tensor,
                     num_speculative_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, K] target-id drafts of one block forward, and their [B, K] confidences (None when not asked)."""
        drafter = self.drafter
        num_requests, k = len(rows), num_speculative_tokens
        from_anchor = self.is_dspark and drafter.sample_from_anchor
        num_rows = k if from_anchor else k + 1
        input_ids = torch.full((num_requests, num_rows), drafter.mask_token_id, dtype=torch.long, device=self.device)
        input_ids[:, 0] = anchors
        positions = anchor_positions[:, None] + np.arange(num_rows)[None, :]
        # Rows past the rotary table (requests at the end of max_model_len) reuse its last position: their drafts
        # are cut anyway, and the rows before them differ only in what they attend.
        positions = np.minimum(positions, drafter.rotary_emb.max_positions - 1)
        max_num_blocks = -(-int(anchor_positions.max()) // self.block_size) or 1
        metadata = BlockDraftMetadata.over(
            query_start_loc=list(range(0, (num_requests + 1) * num_rows, num_rows)),
            context_lens=anchor_positions.tolist(),
            block_table=torch.from_numpy(np.ascontiguousarray(batch.block_table[rows, :max_num_blocks])).to(self.device),
            block_size=self.block_size)
        with set_forward_context(metadata):  # type: ignore[arg-type]
            hidden, _ = drafter(input_ids.reshape(-1), torch.from_numpy(positions.reshape(-1)).to(self.device))
        hidden = hidden.view(num_requests, num_rows, -1)[:, num_rows - k:]
        logits = drafter.compute_draft_logits(hidden.reshape(num_requests * k, -1)).view(num_requests, k, -1)
        if self.is_dspark:
            assert isinstance(drafter, DSparkQwen3ForCausalLM)
            w1, w2 = drafter.markov_weights()
            draft_ids = markov_corrected_drafts(logits, anchors, w1, w2,
                                                drafter.draft_id_to_target_id if drafter.has_vocab_map else None)
        else:
            draft_ids = drafter.map_draft_to_target(first_argmax(logits.reshape(num_requests * k, -1))).view(
                num_requests, k)
        if self.confidence_method is None:
            return draft_ids, None
        if self.confidence_method == "dflash":
            return draft_ids, dflash_confidence(logits)
        assert isinstance(drafter, DSparkQwen3ForCausalLM)
        previous = torch.cat([anchors[:, None], draft_ids[:, :-1]], dim=1)
        return draft_ids, drafter.confidence(hidden.reshape(num_requests * k, -1),
                                             previous.reshape(-1)).view(num_requests, k)


__all__ = ["BlockDraftProposer"]
