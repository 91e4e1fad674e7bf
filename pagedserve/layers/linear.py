"""Tensor-parallel linear layers.

Weights keep PyTorch's [output_size, input_size] layout. Column-parallel layers split the output
dimension across ranks (each rank holds rows [rank*shard, (rank+1)*shard)); row-parallel layers split
the input dimension and sum the partial products with an all-reduce. Fused layers (QKV, gate/up) hold
several logical matrices stacked along the output dimension; their `weight_loader` takes a `shard_id`
naming the logical matrix and writes the local slice of it at the right offset.

`tp_rank`/`tp_size` default to the process's tensor-parallel state; passing them explicitly builds the
shard a given rank would hold (used by tests to simulate several ranks in one process).

Every layer computes through its `linear_method` (vLLM's LinearMethodBase seam): the plain method is
F.linear on the [out, in] weight; after loading, `process_weights_after_loading` may move the weight
into a platform layout (layers/weight_layout.py: oneDNN pre-packed weights on the CPU) and swap the
method. Weight loaders always see the plain layout: a layout is applied only once loading is done.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed import (
    GroupCoordinator,
    get_tp_group,
    resolve_tensor_parallel,
    tensor_model_parallel_all_gather,
)
from pagedserve.layers.quantization.quantization_context import quantized_linear_method
from pagedserve.layers.watched_attributes import WatchedAttributes
from pagedserve.layers.weight_loading import check_shape, divide


class LinearMethodBase:
    """How a linear layer stores its weight after loading and computes x W^T + b (vLLM's seam)."""

    # The layout name this method keeps the weight in ('plain' or a platform layout).
    layout: str = "plain"
    # True for methods whose parameters the checkpoint stores quantized (layers/quantization/): layout transforms
    # and restore_plain_layout leave such layers alone.
    is_quantized: bool = False

    def create_weights(self, layer: "LinearBase", params_dtype: torch.dtype) -> None:
        """Register the layer's parameters (quantized methods only; the plain weight is made by LinearBase)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        """Called once every weight of `layer` is loaded; may replace `layer.weight` by another layout."""

    def apply(self, layer: "LinearBase", x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethodBase):
    """The plain layout: `weight` is [output_size_per_partition, input_size_per_partition]."""

    def apply(self, layer: "LinearBase", x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


UNQUANTIZED_LINEAR_METHOD = UnquantizedLinearMethod()


def packed_weight_of(layer: nn.Module) -> torch.Tensor:
    """The tensor a packed-layout method computes with: the layer's `packed_weight` where it has one (a tied LM
    head keeps a packed copy next to the plain table its embedding reads), else `weight` itself. `layer` is a
    LinearBase or a ParallelLMHead (both carry `packed_weight`)."""
    packed = layer.packed_weight
    return layer.weight if packed is None else packed


class LinearBase(WatchedAttributes, nn.Module):
    """Holds `weight` [output_size_per_partition, input_size_per_partition] and an optional bias."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        params_dtype: torch.dtype | None,
        tp_rank: int | None,
        tp_size: int | None,
        input_size_per_partition: int,
        output_size_per_partition: int,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank, self.tp_size = tp_rank, tp_size  # resolved by subclasses before calling here
        self.input_size_per_partition = input_size_per_partition
        self.output_size_per_partition = output_size_per_partition
        self.prefix = prefix
        # Swapped by layers/weight_layout.py after loading; plain until then (loaders write [out, in]).
        self.linear_method: LinearMethodBase = UNQUANTIZED_LINEAR_METHOD
        # Set by owners that read `weight` outside this layer's forward (e.g. MLA's kv_b_proj): a layout
        # transform then keeps the plain weight as it is.
        self.weight_read_elsewhere = False
        # A packed copy next to a plain `weight` (only tied LM heads keep one; a linear's packed layouts replace
        # `weight`). An attribute on every layer, so the per-call lookup never falls back to nn.Module's slow
        # __getattr__.
        self.packed_weight: torch.Tensor | None = None
        dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        # A checkpoint's quantization config (set while load_model builds the model) may quantize this layer.
        quantized_method = quantized_linear_method(prefix) if prefix else None
        if quantized_method is not None:
            self.linear_method = quantized_method
            quantized_method.create_weights(self, dtype)
        else:
            # Parameters are filled by the loader, so they start uninitialised (no wasted init pass).
            self.weight = nn.Parameter(
                torch.empty(output_size_per_partition, input_size_per_partition, dtype=dtype), requires_grad=False
            )
            self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(self._bias_size(), dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _bias_size(self) -> int:
        return self.output_size_per_partition

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"in_features={self.input_size_per_partition}, out_features={self.output_size_per_partition}, "
            f"bias={self.bias is not None}, tp_rank={self.tp_rank}, tp_size={self.tp_size}"
        )


class ReplicatedLinear(LinearBase):
    """A plain linear layer whose full weight lives on every rank."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True,
                 params_dtype: torch.dtype | None = None, prefix: str = "") -> None:
        super().__init__(input_size, output_size, bias=bias, params_dtype=params_dtype, tp_rank=0, tp_size=1,
                         input_size_per_partition=input_size, output_size_per_partition=output_size, prefix=prefix)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{self.prefix}: shard_id={shard_id!r} given for a replicated linear layer")
        check_shape(param, loaded_weight, self.prefix or "ReplicatedLinear")
        with torch.no_grad():
            param.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Y = X A^T with A split by output rows across ranks; `gather_output` concatenates the shards."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, gather_output: bool = False,
                 params_dtype: torch.dtype | None = None, tp_rank: int | None = None, tp_size: int | None = None,
                 prefix: str = "") -> None:
        tp_rank, tp_size = resolve_tensor_parallel(tp_rank, tp_size)
        self.gather_output = gather_output
        output_per_partition = self._output_size_per_partition(output_size, tp_size)
        super().__init__(input_size, output_size, bias=bias, params_dtype=params_dtype, tp_rank=tp_rank,
                         tp_size=tp_size, input_size_per_partition=input_size,
                         output_size_per_partition=output_per_partition, prefix=prefix)

    def _output_size_per_partition(self, output_size: int, tp_size: int) -> int:
        return divide(output_size, tp_size, f"{type(self).__name__} output_size")

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{self.prefix}: shard_id={shard_id!r} given for an unfused column-parallel layer")
        shard_size = param.shape[0]
        if loaded_weight.shape[0] != shard_size * self.tp_size:
            raise ValueError(
                f"{self.prefix or type(self).__name__}: checkpoint tensor has {loaded_weight.shape[0]} output rows, "
                f"expected {shard_size * self.tp_size}"
            )
        local = loaded_weight.narrow(0, self.tp_rank * shard_size, shard_size)
        check_shape(param, local, self.prefix or type(self).__name__)
        with torch.no_grad():
            param.copy_(local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self.linear_method.apply(self, x, self.bias)
        if self.gather_output:
            output = tensor_model_parallel_all_gather(output, dim=-1)
        return output


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices of sizes `output_sizes` stacked along the output (e.g. gate and up).

    Each rank holds, for every logical matrix i, its rows [rank*s_i, (rank+1)*s_i) with s_i =
    output_sizes[i] / tp_size, packed one after the other. `shard_id` is the matrix index.
    """

    def __init__(self, input_size: int, output_sizes: list[int], *, bias: bool = True,
                 gather_output: bool = False, params_dtype: torch.dtype | None = None,
                 tp_rank: int | None = None, tp_size: int | None = None, prefix: str = "") -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias=bias, gather_output=gather_output,
                         params_dtype=params_dtype, tp_rank=tp_rank, tp_size=tp_size, prefix=prefix)

    def _output_size_per_partition(self, output_size: int, tp_size: int) -> int:
        return sum(divide(size, tp_size, f"{type(self).__name__} output_sizes[{index}]")
                   for index, size in enumerate(self.output_sizes))

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None:
            # A checkpoint that already stores the fused matrix: split it into its logical parts.
            offset = 0
            for index, size in enumerate(self.output_sizes):
                self.weight_loader(param, loaded_weight.narrow(0, offset, size), index)
                offset += size
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"{self.prefix}: shard_id={shard_id!r} must be an int in [0, {len(self.output_sizes) - 1}]")
        shard_size = self.output_sizes[shard_id] // self.tp_size
        shard_offset = sum(size // self.tp_size for size in self.output_sizes[:shard_id])
        if loaded_weight.shape[0] != self.output_sizes[shard_id]:
            raise ValueError(
                f"{self.prefix or type(self).__name__}: shard {shard_id} has {loaded_weight.shape[0]} rows, "
                f"expected {self.output_sizes[shard_id]}"
            )
        local = loaded_weight.narrow(0, self.tp_rank * shard_size, shard_size)
        destination = param.narrow(0, shard_offset, shard_size)
        check_shape(destination, local, self.prefix or type(self).__name__)
        with torch.no_grad():
            destination.copy_(local)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused query/key/value projection with grouped-query attention.

    Query heads split evenly across ranks. Key/value heads split too when there are at least as many as
    ranks; otherwise each KV head is replicated on `tp_size // total_num_kv_heads` consecutive ranks, and
    every rank holds exactly one KV head (rank r holds KV head r // num_kv_head_replicas).
    `shard_id` is 'q', 'k' or 'v'.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, *, bias: bool = True,
                 params_dtype: torch.dtype | None = None, tp_rank: int | None = None, tp_size: int | None = None,
                 prefix: str = "") -> None:
        tp_rank, tp_size = resolve_tensor_parallel(tp_rank, tp_size)
        total_num_kv_heads = total_num_heads if total_num_kv_heads is None else total_num_kv_heads
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "QKVParallelLinear total_num_heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads, "tp_size over total_num_kv_heads; tp_size")
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "QKVParallelLinear total_num_kv_heads")
            self.num_kv_head_replicas = 1
        # The "logical" output is the checkpoint's q|k|v; each rank's partition is its own q|k|v slice.
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size
        super().__init__(hidden_size, output_size, bias=bias, gather_output=False, params_dtype=params_dtype,
                         tp_rank=tp_rank, tp_size=tp_size, prefix=prefix)

    def _output_size_per_partition(self, output_size: int, tp_size: int) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_size

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size

    def shard_layout(self, shard_id: str) -> tuple[int, int, int, int]:
        """(offset in the local partition, local size, index of the source block, full size) of a shard."""
        if shard_id == "q":
            return 0, self.q_size, self.tp_rank, self.total_num_heads * self.head_size
        if shard_id == "k":
            return (self.q_size, self.kv_size, self.tp_rank // self.num_kv_head_replicas,
                    self.total_num_kv_heads * self.head_size)
        if shard_id == "v":
            return (self.q_size + self.kv_size, self.kv_size, self.tp_rank // self.num_kv_head_replicas,
                    self.total_num_kv_heads * self.head_size)
        raise ValueError(f"{self.prefix}: shard_id={shard_id!r} must be one of 'q', 'k', 'v'")

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None:
            # A checkpoint that stores the fused q|k|v matrix.
            q_full = self.total_num_heads * self.head_size
            kv_full = self.total_num_kv_heads * self.head_size
            for name, start, size in (("q", 0, q_full), ("k", q_full, kv_full), ("v", q_full + kv_full, kv_full)):
                self.weight_loader(param, loaded_weight.narrow(0, start, size), name)
            return
        offset, size, source_index, full_size = self.shard_layout(shard_id)  # type: ignore[arg-type]
        if loaded_weight.shape[0] != full_size:
            raise ValueError(
                f"{self.prefix or type(self).__name__}: shard {shard_id!r} has {loaded_weight.shape[0]} rows, "
                f"expected {full_size}"
            )
        local = loaded_weight.narrow(0, source_index * size, size)
        destination = param.narrow(0, offset, size)
        check_shape(destination, local, self.prefix or type(self).__name__)
        with torch.no_grad():
            destination.copy_(local)


class RowParallelLinear(LinearBase):
    """Y = X A^T with A split by input columns across ranks; partial products are summed by all-reduce.

    The bias is added once: rank 0 adds it before the reduction, the other ranks do not.
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, input_is_parallel: bool = True,
                 reduce_results: bool = True, params_dtype: torch.dtype | None = None,
                 tp_rank: int | None = None, tp_size: int | None = None, group: GroupCoordinator | None = None,
                 prefix: str = "") -> None:
        # `group`: the ranks whose partial products are summed (default: the TP group; the o_proj's
        # fine-grained degree passes its own).
        self.group = group
        tp_rank, tp_size = resolve_tensor_parallel(tp_rank, tp_size, group)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        input_per_partition = divide(input_size, tp_size, "RowParallelLinear input_size")
        super().__init__(input_size, output_size, bias=bias, params_dtype=params_dtype, tp_rank=tp_rank,
                         tp_size=tp_size, input_size_per_partition=input_per_partition,
                         output_size_per_partition=output_size, prefix=prefix)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{self.prefix}: shard_id={shard_id!r} given for a row-parallel layer")
        if param.dim() == 2:  # the weight: split the input columns; the bias stays whole
            shard_size = param.shape[1]
            if loaded_weight.dim() != 2 or loaded_weight.shape[1] != shard_size * self.tp_size:
                raise ValueError(
                    f"{self.prefix or type(self).__name__}: checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
                    f"expected ({param.shape[0]}, {shard_size * self.tp_size})"
                )
            loaded_weight = loaded_weight.narrow(1, self.tp_rank * shard_size, shard_size)
        check_shape(param, loaded_weight, self.prefix or type(self).__name__)
        with torch.no_grad():
            param.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and self.tp_size > 1:
            shard_size = self.input_size_per_partition
            x = x.narrow(-1, self.tp_rank * shard_size, shard_size)
        bias = self.bias if self.tp_rank == 0 else None
        output = self.linear_method.apply(self, x, bias)
        if self.reduce_results and self.tp_size > 1:
            output = (self.group if self.group is not None else get_tp_group()).all_reduce(output)
        return output
