"""Greedy steps sampled inside the LM head: each row's argmax without the logits.

When every sampled row is greedy and nothing else reads the logits (no logprobs, penalties or min_tokens), all
the sampler does is `first_argmax(logits)`. With weight_layout='amx_packed' on the CPU, the LM head's kernel
keeps each row's first maximum in its epilogue instead (`amx_linear_first_argmax`,
kernels/cpu/amx_linear.cpp). It writes no [rows, vocab] bf16 logits for first_argmax to read back, and gives the
same token ids bit for bit: the kernel compares the very bf16 values `amx_linear` would store, ties go to the
lowest index, and the first NaN wins. SmolLM2-135M's head (49152 x 576), weights in DRAM, medians of 8
interleaved runs: 4.32 -> 3.25 ms at 64 rows, 2.46 -> 2.31 ms at 16, 2.10 -> 2.03 ms at one row.

Where the native decode stack takes a decode step (models/native_decode_stack.py), the runner asks it for the
token ids instead: `decode_rows_greedy` runs the same head kernel inside the step's own parallel region.
Otherwise the model runner asks `FusedGreedySampler` first. It answers None, and the logits path runs as before, for
batches that need more than the argmax, for heads it cannot take (other layouts, a vocabulary split over ranks,
enable_reduce_sample), and under torch.compile tracing.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from pagedserve.layers.amx_linear import AmxPackedLinearMethod, load_amx_op
from pagedserve.layers.linear import packed_weight_of
from pagedserve.sample.sampler import SamplerOutput
from pagedserve.sample.sampling_metadata import SamplingMetadata


def _first_argmax_fake(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int,
                       num_columns: int, products: str = "auto", allowed: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((x.shape[0],), dtype=torch.long)


@functools.cache
def _fused_op() -> Any:
    """The op, looked up (and the native library built) at first call; None where it cannot run."""
    return load_amx_op("amx_linear_first_argmax", _first_argmax_fake)


def fused_op_available() -> bool:
    """Whether the native library has the fused op and a product unit this process can run (every native build
    has one: layers/amx_linear.py `amx_linear_products`)."""
    return _fused_op() is not None


def amx_linear_first_argmax(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, output_size: int,
                            num_columns: int, products: str = "auto",
                            allowed: torch.Tensor | None = None) -> torch.Tensor:
    """[M] int64: the first index of each row's maximum of bf16(x @ W^T + b)[:, :num_columns], W [output_size, K]
    packed by `amx_pack`, on the product unit `products` names (layers/amx_linear.py `amx_linear_products`).
    `allowed` (structured outputs): int32 [M, words], each row's grammar bitmask; a disallowed column counts as
    -inf, as in the masked logits' first argmax (structured_output/logits_mask.py). Requires
    `fused_op_available()`."""
    return _fused_op()(x, packed, bias, output_size, num_columns, products, allowed)


def is_plain_greedy(metadata: SamplingMetadata) -> bool:
    """True when the sampler would return first_argmax of the logits as they come, and nothing else."""
    return metadata.all_greedy and metadata.min_tokens_row_ids is None and metadata.no_penalties \
        and metadata.max_num_logprobs is None


def greedy_head_arguments(lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, int, int] | None:
    """(packed weight, bias, output size, columns sampled): the fused op's arguments for `lm_head`, or None when it
    cannot take the head (another weight layout, a vocabulary split over ranks) or cannot run here."""
    if type(getattr(lm_head, "linear_method", None)) is not AmxPackedLinearMethod:
        return None
    if lm_head.parallel_group.world_size != 1 or lm_head.vocab_start_index != 0:
        return None  # a vocabulary split over ranks: the full logits are gathered first
    if not fused_op_available():
        return None
    return packed_weight_of(lm_head), lm_head.bias, lm_head.num_embeddings_per_partition, lm_head.org_vocab_size


def head_first_argmax(lm_head: nn.Module, hidden_states: torch.Tensor,
                      allowed: torch.Tensor | None = None) -> torch.Tensor | None:
    """first_argmax(lm_head.compute_logits(hidden_states, dtype=None)) from the head's kernel, or None when the head
    or the input is not one the fused op takes. `allowed`: each row's grammar bitmask (amx_linear_first_argmax)."""
    if hidden_states.dim() != 2 or hidden_states.dtype != torch.bfloat16 or hidden_states.device.type != "cpu" \
            or hidden_states.stride(-1) != 1 or torch.compiler.is_compiling():
        return None
    arguments = greedy_head_arguments(lm_head)
    return None if arguments is None else _fused_op()(hidden_states, *arguments, "auto", allowed)


class FusedGreedySampler:
    """Callable (hidden states at the sampled positions, sampling metadata) -> SamplerOutput, or None when the
    logits and the Sampler must run (module docstring)."""

    def __init__(self, model: nn.Module, enable_reduce_sample: bool) -> None:
        self.model = model
        # reduce_sample computes its own candidates from the vocabulary shards.
        self.is_enabled = not enable_reduce_sample

    def __call__(self, hidden_states: torch.Tensor, metadata: SamplingMetadata,
                 allowed: torch.Tensor | None = None) -> SamplerOutput | None:
        """`allowed` (structured outputs): int32 [rows, words], each row's grammar bitmask."""
        if not self.is_enabled or not is_plain_greedy(metadata):
            return None
        # Looked up per call: a model without an LM head here (an earlier pipeline stage) has nothing to fuse.
        lm_head = getattr(self.model, "lm_head", None)
        token_ids = None if lm_head is None else head_first_argmax(lm_head, hidden_states, allowed)
        return None if token_ids is None else SamplerOutput(sampled_token_ids=token_ids, logprobs=None)


__all__ = ["FusedGreedySampler", "amx_linear_first_argmax", "fused_op_available", "greedy_head_arguments",
           "head_first_argmax", "is_plain_greedy"]
