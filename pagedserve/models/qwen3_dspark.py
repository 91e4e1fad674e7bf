"""DSpark block drafter (speculative method 'dspark'): DFlash's parallel block forward plus a low-rank Markov head
that makes each draft depend on the one before it, and a confidence head that predicts each draft's acceptance.

Checkpoint tensors, beyond DFlash's (models/qwen3_dflash.py): markov_head.markov_w1.weight [vocab, r] (the
previous token's rank-r embedding, indexed by target id), markov_head.markov_w2.weight [draft vocab, r] (back to
a logit bias), confidence_head.proj.weight [1, H (+ r)] and confidence_head.proj.bias [1] (when the config's
`enable_confidence_head`; `confidence_head_with_markov` adds the previous token's Markov embedding to its
input). config.json: `markov_rank`, and `sample_from_anchor` (default true: the block is [anchor, mask x (K-1)]
and row i predicts the token after it; false: DFlash's [anchor, mask x K], row j predicting its own position).

Greedy drafting: d_0 = the anchor, d_{i+1} = argmax(base logits of row i + markov_w2 @ markov_w1[d_i]); the
confidence of draft i + 1 is sigmoid(proj([h_i ; markov_w1[d_i]])) in float32.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.models.qwen3_dflash import DFlashQwen3ForCausalLM, block_drafter_setting


class DSparkQwen3ForCausalLM(DFlashQwen3ForCausalLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, *,
                 checkpoint_names: frozenset[str] = frozenset(), target_num_layers: int) -> None:
        super().__init__(hf_config, dtype, checkpoint_names=checkpoint_names, target_num_layers=target_num_layers)
        rank = int(block_drafter_setting(hf_config, "markov_rank"))
        if rank < 1:
            raise ValueError(f"markov_rank={rank} must be >= 1")
        self.sample_from_anchor = bool(block_drafter_setting(hf_config, "sample_from_anchor", True))
        self.markov_head = nn.Module()
        self.markov_head.markov_w1 = nn.Embedding(self.vocab_size, rank, dtype=dtype)
        self.markov_head.markov_w2 = nn.Linear(rank, self.draft_vocab_size, bias=False, dtype=dtype)
        self.has_confidence_head = bool(block_drafter_setting(hf_config, "enable_confidence_head", False)) \
            and "confidence_head.proj.weight" in self.checkpoint_tensor_names
        self.confidence_with_markov = bool(block_drafter_setting(hf_config, "confidence_head_with_markov", False))
        if self.has_confidence_head:
            width = hf_config.hidden_size + (rank if self.confidence_with_markov else 0)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = nn.Linear(width, 1, bias="confidence_head.proj.bias" in self.checkpoint_tensor_names,
                                                  dtype=torch.float32)

    def markov_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1 [vocab, r], w2 [r, draft vocab]) for spec_decode's markov_corrected_drafts."""
        return self.markov_head.markov_w1.weight, self.markov_head.markov_w2.weight.t()

    def confidence(self, hidden_states: torch.Tensor, previous_token_ids: torch.Tensor) -> torch.Tensor:
        """[n, H] block-row hidden states and the token before each row's draft -> [n] acceptance probabilities."""
        assert self.has_confidence_head
        features = hidden_states
        if self.confidence_with_markov:
            features = torch.cat([hidden_states, self.markov_head.markov_w1(previous_token_ids)], dim=-1)
        return torch.sigmoid(self.confidence_head.proj(features.float()).squeeze(-1))


__all__ = ["DSparkQwen3ForCausalLM"]
