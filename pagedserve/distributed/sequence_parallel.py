"""Sequence parallel for tensor parallelism (`enable_sequence_parallel`): the residual stream split by tokens.

Under plain TP every rank holds every token's hidden state, and each attention and MLP block ends in an all-reduce
of its row-parallel output (o_proj, down_proj), after which every rank runs the same residual add and RMSNorm on
all tokens. With sequence parallel the residual stream is split by tokens over the TP ranks (rank r holds rows
[r * s, (r + 1) * s) of the step, padded to a multiple of the TP size):
- the row-parallel output is reduce-scattered instead of all-reduced (same bytes received, 1/tp of them kept);
- residual add and norm run on the rank's rows only;
- an all-gather restores every token before the next column-parallel GEMM (qkv_proj, gate_up_proj) and after the
  final norm (the LM head and the sampler see every token).
The sums are the all-reduce's, so outputs equal SP off.

It plugs into a loaded model through module hooks (`apply_sequence_parallel`): the embedding's output is
scattered, each decoder layer's attention and MLP inputs are gathered, o_proj / down_proj reduce-scatter instead of
all-reducing, and the final norm's output is gathered. Supported: decoder stacks of the Llama form (Llama, Qwen2,
Qwen3, Mistral: dense MLPs with a row-parallel down_proj, attention with a TP row-parallel o_proj).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.distributed.parallel_state import GroupCoordinator
from pagedserve.layers.linear import RowParallelLinear

# The architectures whose decoder layers apply_sequence_parallel knows how to split (checked at start).
SEQUENCE_PARALLEL_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


class TokenShards:
    """The step's split of token rows over the group: padded to a multiple of the group size, s rows a rank."""

    def __init__(self, group: GroupCoordinator) -> None:
        self.group = group
        self.num_tokens = 0  # of the current step, set when the embedding output is scattered

    @property
    def num_padded(self) -> int:
        return -(-self.num_tokens // self.group.world_size) * self.group.world_size

    def _padded(self, rows: torch.Tensor) -> torch.Tensor:
        padding = self.num_padded - rows.shape[0]
        return rows if padding == 0 else torch.cat([rows, rows.new_zeros(padding, *rows.shape[1:])])

    def scatter(self, rows: torch.Tensor) -> torch.Tensor:
        """Every token's rows (the same on every rank) -> this rank's shard; starts a step."""
        self.num_tokens = rows.shape[0]
        size = self.num_padded // self.group.world_size
        return self._padded(rows)[self.group.rank * size:(self.group.rank + 1) * size]

    def reduce_scatter(self, partial: torch.Tensor) -> torch.Tensor:
        """Every token's partial sums (one per rank) -> this rank's shard of their sum."""
        partial = self._padded(partial).contiguous()
        if self.group.world_size == 1:
            return partial
        shard = partial.new_empty(partial.shape[0] // self.group.world_size, *partial.shape[1:])
        torch.distributed.reduce_scatter_tensor(shard, partial, group=self.group.process_group)
        return shard

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """Each rank's shard -> every token's rows, padding dropped."""
        return self.group.all_gather(shard, dim=0)[:self.num_tokens]


def _decoder(model: nn.Module) -> nn.Module:
    decoder = getattr(model, "model", None)
    if decoder is None or not all(hasattr(decoder, name) for name in ("embed_tokens", "layers", "norm")):
        raise ValueError(f"enable_sequence_parallel=True: {type(model).__name__} has no decoder stack of the Llama "
                         f"form (model.embed_tokens / layers / norm)")
    return decoder


def _row_parallel(module: nn.Module, name: str, model_name: str, group: GroupCoordinator) -> RowParallelLinear:
    linear = getattr(module, name, None)
    # o_proj at its default degree sums over a group of the TP group's ranks, with nothing to gather first.
    sums_over_tp = isinstance(linear, RowParallelLinear) and linear.reduce_results \
        and (linear.group is None or linear.group.ranks == group.ranks) \
        and getattr(getattr(linear, "gather_group", None), "world_size", 1) == 1
    if not sums_over_tp:
        raise ValueError(f"enable_sequence_parallel=True needs every layer's {name} to be a TP row-parallel linear "
                         f"that sums over the TP group; {model_name} has {type(linear).__name__} (MoE blocks and "
                         f"fine-grained o_proj degrees are not supported)")
    return linear


def apply_sequence_parallel(model: nn.Module, group: GroupCoordinator) -> TokenShards:
    """Split `model`'s residual stream by tokens over `group` (the TP group), through module hooks."""
    decoder = _decoder(model)
    model_name = type(model).__name__
    shards = TokenShards(group)
    blocks = []
    for layer in decoder.layers:
        if not hasattr(layer, "self_attn") or not hasattr(layer, "mlp"):
            continue  # a pipeline placeholder: this stage does not run it
        blocks.append((layer, _row_parallel(layer.self_attn, "o_proj", model_name, group),
                       _row_parallel(layer.mlp, "down_proj", model_name, group)))

    def scatter_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return shards.scatter(output)

    def gather_hidden_states(position: int):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return args[:position] + (shards.gather(args[position]),) + args[position + 1:]
        return hook

    def reduce_scatter_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return shards.reduce_scatter(output)

    def gather_norm_output(module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, tuple):  # (hidden_states, residual) of the fused add + norm
            return (shards.gather(output[0]),) + output[1:]
        return shards.gather(output)

    decoder.embed_tokens.register_forward_hook(scatter_output)
    for layer, o_proj, down_proj in blocks:
        layer.self_attn.register_forward_pre_hook(gather_hidden_states(1))  # self_attn(positions, hidden_states)
        layer.mlp.register_forward_pre_hook(gather_hidden_states(0))
        for linear in (o_proj, down_proj):
            linear.reduce_results = False  # the hook reduce-scatters instead of the all-reduce
            linear.register_forward_hook(reduce_scatter_output)
    decoder.norm.register_forward_hook(gather_norm_output)
    return shards


__all__ = ["SEQUENCE_PARALLEL_ARCHITECTURES", "TokenShards", "apply_sequence_parallel"]
