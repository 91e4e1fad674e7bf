"""Sampler: a batch of logits -> one token (and optionally logprobs) per row, with vLLM v1 semantics.

Order of operations:
  1. raw logprobs (log_softmax of the model's logits), when any row wants logprobs;
  2. min_tokens masking, then repetition / frequency / presence penalties;
  3. greedy rows: argmax of those logits (no randomness);
  4. random rows: temperature, min-p, top-k, top-p, then sample from the softmax.
Sampling needs no host sync: argmax(probs / E) with E ~ Exp(1) i.i.d. picks token i with
probability probs[i] (the exponential race, as in gpt-fast and vLLM). Seeded rows draw E from their
own generator, so their tokens depend neither on the rest of the batch nor on their row position.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.sample.greedy import first_argmax
from pagedserve.sample.logprobs import LogprobsTensors, compute_logprobs, gather_logprobs
from pagedserve.sample.min_tokens import apply_min_tokens
from pagedserve.sample.penalties import apply_penalties
from pagedserve.sample.sampling_metadata import SamplingMetadata
from pagedserve.sample.truncation import apply_min_p, apply_top_k, apply_top_k_top_p

__all__ = ["Sampler", "SamplerOutput", "LogprobsTensors", "random_sample"]


@dataclass
class SamplerOutput:
    """sampled_token_ids: [num_rows] int64; logprobs: None when no row asked for logprobs."""

    sampled_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None


def _exponential_noise(shape: torch.Size, metadata: SamplingMetadata) -> torch.Tensor:
    """Exp(1) noise as -log(U), U ~ Uniform[0, 1): one op from the global RNG, then seeded rows
    redrawn from their own generators.

    -log(U) lies in (0, inf], never 0, so probs / noise never divides by zero (a masked token's
    0 / noise stays 0, never NaN). On CPUs uniform + log is several times faster than exponential_.
    """
    noise = torch.empty(shape, dtype=torch.float32, device=metadata.device)
    if len(metadata.generators) < metadata.num_rows:
        noise.uniform_()
    # The only per-row Python loop: each seeded row advances its own generator by one vocab draw.
    for row, generator in metadata.generators.items():
        noise[row].uniform_(generator=generator)
    return noise.log_().neg_()


def random_sample(probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Draw one token per row from probs ([num_rows, vocab]) via the exponential race.

    argmax_i probs[i] / E[i] with E i.i.d. Exp(1) selects i with probability probs[i].
    probs is overwritten.
    """
    return first_argmax(probs.div_(_exponential_noise(probs.shape, metadata)))


class Sampler(torch.nn.Module):
    """Turns logits into sampled tokens and logprobs; stateless (generators live in the metadata)."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [num_rows, vocab_size] floating point, rows in the metadata's order; not modified.

        Any floating dtype gives the same result as its float32 upcast (the sampler upcasts itself).
        """
        self._check_logits(logits, metadata)
        if metadata.max_num_logprobs is not None:
            raw_logprobs = compute_logprobs(logits)
        if metadata.all_greedy and metadata.min_tokens_row_ids is None and metadata.no_penalties:
            # Nothing changes the logits: take the argmax as they come. Upcasting to float32 is exact and
            # keeps their order (and NaN), so the tokens are the same without a copy of the vocabulary.
            sampled = first_argmax(logits)
        else:
            sampled = self._sample_float32(logits.to(torch.float32), metadata)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def processed_logits(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The float32 logits each row samples from, without sampling: steps 2 and 4's temperature and
        truncation (greedy rows: their penalised logits, whose first argmax is their token). Speculative
        verification reads these; `logits` is not modified."""
        logits = self._penalized(logits.to(torch.float32), metadata)
        if metadata.all_greedy:
            return logits
        processed = self._truncated(logits, metadata)
        if not metadata.all_random:
            processed = torch.where(metadata.is_greedy.unsqueeze(1), logits, processed)
        return processed

    def _sample_float32(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Steps 2-4 on float32 logits (the caller's own tensor when it was float32 already)."""
        logits = self._penalized(logits, metadata)
        if metadata.all_greedy:
            return first_argmax(logits)  # max(dim=-1).indices, in two vectorised passes (sample/greedy.py)
        sampled = random_sample(self._truncated(logits, metadata).softmax(dim=-1), metadata)
        if not metadata.all_random:
            sampled = torch.where(metadata.is_greedy, first_argmax(logits), sampled)
        return sampled

    @staticmethod
    def _penalized(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Step 2, out of place: the caller's logits stay untouched (returned as they are when nothing applies)."""
        if metadata.min_tokens_row_ids is not None:
            logits = apply_min_tokens(logits, metadata.min_tokens_row_ids, metadata.min_tokens_token_ids)
        if not metadata.no_penalties:
            logits = apply_penalties(
                logits, metadata.prompt_token_ids, metadata.output_token_ids, metadata.presence_penalties,
                metadata.frequency_penalties, metadata.repetition_penalties)
        return logits

    @staticmethod
    def _truncated(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Temperature, min-p, top-k and top-p of step 4 (greedy rows divide by 1.0)."""
        # The division makes a fresh tensor, so the in-place truncations below never touch the caller's.
        logits = logits / metadata.temperature.unsqueeze(1)
        if not metadata.no_min_p:
            logits = apply_min_p(logits, metadata.min_p)
        if not metadata.no_top_p:
            # With top-k on every row, only the best max_top_k candidates need sorting.
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p,
                                       metadata.max_top_k if metadata.all_top_k else None)
        elif not metadata.no_top_k:
            # Top-k alone needs no sort: torch.topk up to the largest k gives each row's threshold.
            logits = apply_top_k(logits, metadata.top_k, metadata.max_top_k)
        return logits

    @staticmethod
    def _check_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
        expected = (metadata.num_rows, metadata.vocab_size)
        if logits.dim() != 2 or tuple(logits.shape) != expected:
            raise ValueError(f"logits.shape={tuple(logits.shape)} must be {expected} "
                             "(num_rows, vocab_size) from the sampling metadata")
        if not logits.is_floating_point():
            raise ValueError(f"logits.dtype={logits.dtype} must be a floating point type")
        if logits.device.type != metadata.device.type:
            raise ValueError(f"logits.device={logits.device} must match the metadata's device {metadata.device}")
