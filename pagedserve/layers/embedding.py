"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded so that it splits evenly into per-rank ranges: each rank holds rows
[vocab_start_index, vocab_end_index) of the padded table. Padding rows are zero and never produce
logits that reach the caller (`compute_logits` drops them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed import GroupCoordinator, get_tp_group, resolve_tensor_parallel
from pagedserve.layers.gguf_linear import quantized_rows
from pagedserve.layers.linear import UNQUANTIZED_LINEAR_METHOD, LinearMethodBase
from pagedserve.layers.watched_attributes import WatchedAttributes

# Per-rank vocabulary slices are rounded up to a multiple of this (friendlier matmul shapes).
DEFAULT_VOCAB_PADDING_SIZE = 64


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class VocabParallelEmbedding(WatchedAttributes, nn.Module):
    """Embedding table split by vocabulary rows across tensor-parallel ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, params_dtype: torch.dtype | None = None,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE, tp_rank: int | None = None,
                 tp_size: int | None = None, group: GroupCoordinator | None = None, prefix: str = "") -> None:
        super().__init__()
        if num_embeddings < 1:
            raise ValueError(f"num_embeddings={num_embeddings} must be >= 1")
        # The group the vocabulary is split over: the TP group, or a fine-grained one (lm_head/embedding
        # degree). Looked up at call time when None, so layers built before the groups still work.
        self.group = group
        self.tp_rank, self.tp_size = resolve_tensor_parallel(tp_rank, tp_size, group)
        self.org_vocab_size = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        self.num_embeddings_per_partition = _round_up(-(-num_embeddings // self.tp_size), padding_size)
        self.num_embeddings_padded = self.num_embeddings_per_partition * self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        self.params_dtype = dtype  # the rows' dtype (a GGUF-quantized table's weight is uint8)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        # A ggml block type when `weight` holds a GGUF file's blocks [rows, bytes per row] (layers/gguf_linear.py;
        # set before loading by model_loader/gguf_quantized_load.py); None for a float table.
        self.ggml_type: int | None = None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        """Copy this rank's rows of the [org_vocab_size, embedding_dim] checkpoint table; zero the padding."""
        if shard_id is not None:
            raise ValueError(f"{self.prefix}: shard_id={shard_id!r} given for a vocabulary-parallel table")
        # A float table has embedding_dim columns; a GGUF-quantized one its bytes per row.
        if tuple(loaded_weight.shape) != (self.org_vocab_size, param.shape[1]):
            raise ValueError(
                f"{self.prefix or type(self).__name__}: checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
                f"expected ({self.org_vocab_size}, {param.shape[1]})"
            )
        start = min(self.vocab_start_index, self.org_vocab_size)
        end = min(self.vocab_end_index, self.org_vocab_size)
        with torch.no_grad():
            param.zero_()
            param[: end - start].copy_(loaded_weight[start:end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._rows(input_ids)
        # Ids outside this rank's range look up row 0 and are zeroed; the all-reduce fills them in.
        is_outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = torch.where(is_outside, torch.zeros_like(input_ids), input_ids - self.vocab_start_index)
        output = self._rows(local_ids)
        output = output.masked_fill(is_outside.unsqueeze(-1), 0)
        return self._group().all_reduce(output)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ggml_type is None:
            return F.embedding(ids, self.weight)
        return quantized_rows(self.weight, self.ggml_type, self.embedding_dim, ids, self.params_dtype)

    def _group(self) -> GroupCoordinator:
        return self.group if self.group is not None else get_tp_group()

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.org_vocab_size}, padded_per_partition={self.num_embeddings_per_partition}, "
                f"embedding_dim={self.embedding_dim}, tp_rank={self.tp_rank}, tp_size={self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary, split by vocabulary rows across ranks.

    Not called as a module: `compute_logits` projects hidden states and gathers the vocabulary shards.
    With tied embeddings the model points `weight` at the input embedding's parameter.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, bias: bool = False,
                 params_dtype: torch.dtype | None = None, padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
                 tp_rank: int | None = None, tp_size: int | None = None, group: GroupCoordinator | None = None,
                 prefix: str = "") -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype=params_dtype, padding_size=padding_size,
                         tp_rank=tp_rank, tp_size=tp_size, group=group, prefix=prefix)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.num_embeddings_per_partition, dtype=self.weight.dtype),
                                     requires_grad=False)
            self.bias.weight_loader = self._bias_loader
        else:
            self.register_parameter("bias", None)
        # True once `weight` is the input embedding's parameter (tie_word_embeddings).
        self.is_tied = False
        # The weight in a packed layout when weight_layout packed this head (set and cleared by
        # layers/weight_layout.py); the packed linear methods then read it instead of `weight`.
        self.packed_weight: torch.Tensor | None = None
        # How the logits GEMM runs (layers/linear.py's seam; weight_layout may swap it).
        self.linear_method: LinearMethodBase = UNQUANTIZED_LINEAR_METHOD

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        """Share the input embedding's parameter (tie_word_embeddings)."""
        if (embedding.num_embeddings_per_partition != self.num_embeddings_per_partition
                or embedding.vocab_start_index != self.vocab_start_index):
            raise ValueError("cannot tie an LM head and an embedding with different vocabulary partitions "
                             "(lmhead_tensor_parallel_size and embedding_tensor_parallel_size must match)")
        self.weight = embedding.weight
        self.is_tied = True

    def _bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if tuple(loaded_weight.shape) != (self.org_vocab_size,):
            raise ValueError(f"{self.prefix}.bias: checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
                             f"expected ({self.org_vocab_size},)")
        start = min(self.vocab_start_index, self.org_vocab_size)
        end = min(self.vocab_end_index, self.org_vocab_size)
        with torch.no_grad():
            param.zero_()
            param[: end - start].copy_(loaded_weight[start:end])

    def compute_logits(self, hidden_states: torch.Tensor,
                       dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """[num_tokens, hidden] -> logits [num_tokens, org_vocab_size] (all ranks see all columns), in `dtype`.

        dtype=None keeps the GEMM's dtype (the model's) and skips a copy of the whole vocabulary: the
        sampler upcasts only where it computes on the values (the upcast is exact, so results match).
        """
        logits = self._group().all_gather(self.compute_local_logits(hidden_states), dim=-1)
        logits = logits[..., : self.org_vocab_size]
        return logits if dtype is None else logits.to(dtype)

    def compute_local_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary shard of the logits, [num_tokens, num_embeddings_per_partition]
        (padding columns included; global id = column + vocab_start_index)."""
        return self.linear_method.apply(self, hidden_states, self.bias)

    @property
    def output_size_per_partition(self) -> int:
        """The logits GEMM's output columns on this rank (the linear-method seam's name)."""
        return self.num_embeddings_per_partition

    @property
    def input_size_per_partition(self) -> int:
        return self.embedding_dim

    @property
    def parallel_group(self) -> GroupCoordinator:
        """The group the vocabulary is split over."""
        return self._group()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not called directly; use compute_logits(hidden_states)")
