"""The attention output projection (o_proj) with its own tensor-parallel degree.

With oproj_tensor_parallel_size = k (k divides tp_size, m = tp_size / k) the o_proj weight is split k
ways by input columns. Attention leaves each TP rank with its own heads; the m consecutive ranks whose
heads make up one o_proj input shard concatenate them (all-gather in the "oproj gather" group), each
computes its shard's partial product, and the k ranks holding different shards sum them (all-reduce in
the "oproj" group). At k = tp_size this is exactly a row-parallel linear over the TP group; at k = 1 the
o_proj is replicated and the only collective is the gather of the heads.
"""
from __future__ import annotations

import torch

from pagedserve.distributed import GroupCoordinator, get_oproj_gather_group, get_oproj_tp_group
from pagedserve.layers.linear import RowParallelLinear


class AttentionOutputProjection(RowParallelLinear):
    def __init__(self, input_size: int, output_size: int, *, bias: bool = True,
                 params_dtype: torch.dtype | None = None, gather_group: GroupCoordinator | None = None,
                 reduce_group: GroupCoordinator | None = None, prefix: str = "") -> None:
        self.gather_group = gather_group if gather_group is not None else get_oproj_gather_group()
        reduce_group = reduce_group if reduce_group is not None else get_oproj_tp_group()
        super().__init__(input_size, output_size, bias=bias, params_dtype=params_dtype, group=reduce_group,
                         prefix=prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.gather_group.all_gather(x, dim=-1))
