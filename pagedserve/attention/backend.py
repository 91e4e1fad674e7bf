"""The attention backend seam: per-step metadata and the interface every backend implements.

KV cache layout (one tensor per attention layer, allocated by the worker):
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)
A token at position p of a request lives in slot `block_table[p // block_size] * block_size + p % block_size`.
Block 0 is the null block: never written by a live request, used to pad block tables.

Token order in a step: the scheduled tokens of request 0, then of request 1, ... (query_start_loc gives
the boundaries). Requests with a single new token (decodes) may come in any position; backends must not
assume decodes come first, but `num_decodes`/`num_decode_tokens` say how many requests, placed first,
are single-token decodes when the runner orders them that way (it does: decodes first, then prefills).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pagedserve.attention.decode_context_parallel import ContextParallelStep


@dataclass
class AttentionMetadata:
    num_actual_tokens: int
    # [num_tokens] int64: flat slot index for each new token's K/V.
    slot_mapping: torch.Tensor
    # [num_seqs + 1] int32: prefix sums of the new tokens per request.
    query_start_loc: torch.Tensor
    # [num_seqs] int32: context length of each request after this step (cached + new tokens).
    seq_lens: torch.Tensor
    # [num_seqs, max_num_blocks] int32, padded with 0 (the null block).
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # The first `num_decodes` requests have exactly one new token each (num_decode_tokens == num_decodes).
    num_decodes: int
    num_decode_tokens: int
    # Host copies, so backends that loop over requests need no device->host sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    # Per-step scratch for backends: anything derived from this metadata alone (e.g. a decode plan)
    # is built by the first layer and reused by the others. A new metadata object comes every step.
    backend_cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    # Decode context parallel (attention/decode_context_parallel.py): the group and the step's tokens this rank
    # stores (slot_mapping then holds just their slots); None without DCP.
    context_parallel: "ContextParallelStep | None" = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(ABC):
    """Computes attention for one layer over the paged KV cache.

    `forward` first writes the new tokens' K/V into `kv_cache` at `metadata.slot_mapping`, then attends
    each new query token to its request's context (cached tokens + new tokens up to itself).
    """

    name: str = "abstract"

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
