"""Process groups carved from one torch.distributed world, and the collectives layers use.

World layout (rank = ((dp_rank * pp_size + pp_rank) * pcp_size + pcp_rank) * tp_size + tp_rank), the same order
as vLLM (pcp: prefill context parallel, 1 unless set):

- TP groups: consecutive blocks of `tp_size` ranks (same dp, pp and pcp index).
- PP groups: ranks with the same (dp, pcp, tp) index, one per stage.
- DP groups: ranks with the same (pp, pcp, tp) index.
- EP group: DP x TP of one pipeline stage and one PCP rank (the MoE experts are split over it).
- PCP groups: ranks with the same (dp, pp, tp) index; they split each step's tokens
  (distributed/prefill_context_parallel.py).
- Context-parallel KV groups ("cp_kv"): the PCP x DCP ranks that split every request's KV positions
  (attention/decode_context_parallel.py); group rank = pcp_rank * dcp_size + dcp_rank.
- Fine-grained TP groups (lm_head, word embedding, attention o_proj) carved from each TP group:
  for a module degree k (k divides tp_size) a module group is a block of k consecutive TP ranks, and
  the module's weight is split k ways and replicated tp_size / k times. The o_proj additionally needs
  the "gather" group: the tp_size / k consecutive ranks whose attention heads feed one o_proj shard.
  (vllm-ascend carves these groups from DP instead; see docs/params-05-parallel.md for why we don't.)

Every group is a `GroupCoordinator`; at size 1 every collective is the identity (no torch.distributed
call), so the single-process engine never initialises torch.distributed at all.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed


@dataclass
class GroupCoordinator:
    """One process group: this process's rank in it, its size, the global ranks and the torch group."""

    name: str = "default"
    rank: int = 0
    world_size: int = 1
    ranks: list[int] = field(default_factory=lambda: [0])
    process_group: "torch.distributed.ProcessGroup | None" = None

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.world_size - 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the group, in place (identity on one rank)."""
        if self.world_size == 1:
            return tensor
        torch.distributed.all_reduce(tensor, group=self.process_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate each rank's `tensor` (same shape everywhere) along `dim` in rank order."""
        if self.world_size == 1:
            return tensor
        dim = dim % tensor.dim()
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        torch.distributed.all_gather(gathered, tensor.contiguous(), group=self.process_group)
        return torch.cat(gathered, dim=dim)

    def all_to_all_single(self, tensor: torch.Tensor, output_split_sizes: list[int] | None = None,
                          input_split_sizes: list[int] | None = None) -> torch.Tensor:
        """Exchange slices of dim 0: rank i sends input slice j to rank j and receives output slice i
        from every rank j. Split sizes default to equal slices (dim 0 divisible by the group size)."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        if output_split_sizes is None:
            if tensor.shape[0] % self.world_size:
                raise ValueError(f"all_to_all_single: dim 0 ({tensor.shape[0]}) is not divisible by the "
                                 f"{self.name} group size {self.world_size}; pass split sizes")
            num_rows = tensor.shape[0]
        else:
            num_rows = sum(output_split_sizes)
        output = tensor.new_empty((num_rows, *tensor.shape[1:]))
        torch.distributed.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes,
                                            group=self.process_group)
        return output

    def broadcast(self, tensor: torch.Tensor, source_rank: int = 0) -> torch.Tensor:
        """Overwrite `tensor` with the group-local `source_rank`'s copy (identity on one rank)."""
        if self.world_size == 1:
            return tensor
        torch.distributed.broadcast(tensor, src=self.ranks[source_rank], group=self.process_group)
        return tensor

    def send(self, tensor: torch.Tensor, destination_rank: int) -> None:
        """Point-to-point send to the group-local `destination_rank` (pipeline stages)."""
        torch.distributed.send(tensor.contiguous(), dst=self.ranks[destination_rank], group=self.process_group)

    def recv(self, tensor: torch.Tensor, source_rank: int) -> torch.Tensor:
        torch.distributed.recv(tensor, src=self.ranks[source_rank], group=self.process_group)
        return tensor

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier(group=self.process_group)


@dataclass(frozen=True)
class ParallelSizes:
    """The degrees the groups are carved with (0 for a fine-grained degree means 'same as tp')."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    lmhead_tensor_parallel_size: int = 0
    embedding_tensor_parallel_size: int = 0
    oproj_tensor_parallel_size: int = 0
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return (self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size
                * self.prefill_context_parallel_size)

    def module_degree(self, value: int) -> int:
        return self.tensor_parallel_size if value == 0 else value


_GROUP_NAMES = ("tp", "pp", "dp", "ep", "lmhead_tp", "embedding_tp", "oproj_tp", "oproj_gather", "dcp", "pcp",
               "cp_kv")


def _single(name: str) -> GroupCoordinator:
    return GroupCoordinator(name=name)


_groups: dict[str, GroupCoordinator] = {name: _single(name) for name in _GROUP_NAMES}


def group_rank_lists(sizes: ParallelSizes) -> dict[str, list[list[int]]]:
    """Every group of every kind as lists of global ranks (pure: unit-testable without a world)."""
    tp, pp, dp = sizes.tensor_parallel_size, sizes.pipeline_parallel_size, sizes.data_parallel_size
    pcp = sizes.prefill_context_parallel_size

    def rank_of(dp_rank: int, pp_rank: int, tp_rank: int, pcp_rank: int = 0) -> int:
        return ((dp_rank * pp + pp_rank) * pcp + pcp_rank) * tp + tp_rank

    groups: dict[str, list[list[int]]] = {name: [] for name in _GROUP_NAMES}
    for d in range(dp):
        for p in range(pp):
            for c in range(pcp):
                groups["tp"].append([rank_of(d, p, t, c) for t in range(tp)])
    for c in range(pcp):
        for d in range(dp):
            for t in range(tp):
                groups["pp"].append([rank_of(d, p, t, c) for p in range(pp)])
        for p in range(pp):
            for t in range(tp):
                groups["dp"].append([rank_of(d, p, t, c) for d in range(dp)])
        for p in range(pp):
            groups["ep"].append([rank_of(d, p, t, c) for d in range(dp) for t in range(tp)])
    for d in range(dp):
        for p in range(pp):
            for t in range(tp):
                groups["pcp"].append([rank_of(d, p, t, c) for c in range(pcp)])
    for name, value in (("lmhead_tp", sizes.lmhead_tensor_parallel_size),
                        ("embedding_tp", sizes.embedding_tensor_parallel_size)):
        degree = sizes.module_degree(value)
        for tp_group in groups["tp"]:
            groups[name].extend(tp_group[start:start + degree] for start in range(0, tp, degree))
    # o_proj of degree k: shard s holds the input columns of head shards [s*m, (s+1)*m), m = tp/k, so rank
    # t computes shard t // m after concatenating the heads of its m consecutive ranks (gather group);
    # the k ranks holding different shards (every m-th rank) sum their partial products (module group).
    gather = tp // sizes.module_degree(sizes.oproj_tensor_parallel_size)
    for tp_group in groups["tp"]:
        groups["oproj_gather"].extend(tp_group[start:start + gather] for start in range(0, tp, gather))
        groups["oproj_tp"].extend(tp_group[index::gather] for index in range(gather))
    # Decode context parallel: blocks of consecutive TP ranks, which hold the same KV heads (replicas are
    # consecutive, QKVParallelLinear) or the same MLA latent, and split the positions among them.
    dcp = sizes.decode_context_parallel_size
    for tp_group in groups["tp"]:
        groups["dcp"].extend(tp_group[start:start + dcp] for start in range(0, tp, dcp))
    # The KV positions of a request are split over the DCP blocks at the same place of every PCP rank's TP group.
    for d in range(dp):
        for p in range(pp):
            for start in range(0, tp, dcp):
                groups["cp_kv"].append([rank_of(d, p, t, c) for c in range(pcp) for t in range(start, start + dcp)])
    return groups


def initialize_model_parallel(sizes: ParallelSizes) -> None:
    """Carve every group from the initialised torch.distributed world (whose size must match).

    Every rank must call this with the same sizes: torch.distributed.new_group is collective.
    """
    global _groups
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world_size != sizes.world_size:
        raise ValueError(f"world size {world_size} != tensor_parallel_size x pipeline_parallel_size x "
                         f"data_parallel_size x prefill_context_parallel_size = {sizes.world_size}")
    rank = torch.distributed.get_rank() if world_size > 1 else 0
    groups: dict[str, GroupCoordinator] = {}
    for name, rank_lists in group_rank_lists(sizes).items():
        for ranks in rank_lists:
            # new_group is collective over the whole world: every rank creates every group.
            process_group = torch.distributed.new_group(ranks) if world_size > 1 and len(ranks) > 1 else None
            if rank in ranks:
                groups[name] = GroupCoordinator(name=name, rank=ranks.index(rank), world_size=len(ranks),
                                                ranks=list(ranks), process_group=process_group)
    _groups = groups


def destroy_model_parallel() -> None:
    """Return to the single-rank state (groups of size 1)."""
    global _groups
    _groups = {name: _single(name) for name in _GROUP_NAMES}


def get_tp_group() -> GroupCoordinator:
    return _groups["tp"]


def get_pp_group() -> GroupCoordinator:
    return _groups["pp"]


def get_dp_group() -> GroupCoordinator:
    return _groups["dp"]


def get_ep_group() -> GroupCoordinator:
    """Expert-parallel group: DP x TP ranks of this pipeline stage (rank, world_size, process_group,
    all_to_all_single)."""
    return _groups["ep"]


def get_lmhead_tp_group() -> GroupCoordinator:
    return _groups["lmhead_tp"]


def get_embedding_tp_group() -> GroupCoordinator:
    return _groups["embedding_tp"]


def get_oproj_tp_group() -> GroupCoordinator:
    """The ranks holding different o_proj input shards (their partial products are summed)."""
    return _groups["oproj_tp"]


def get_dcp_group() -> GroupCoordinator:
    """The decode-context-parallel group: the ranks that split each request's KV positions
    (position p on group rank p % world_size)."""
    return _groups["dcp"]


def get_pcp_group() -> GroupCoordinator:
    """The prefill-context-parallel group: the ranks (same TP index) that split each step's tokens."""
    return _groups["pcp"]


def get_context_parallel_kv_group() -> GroupCoordinator:
    """The PCP x DCP ranks that split each request's KV positions (position p on group rank p % world_size);
    the DCP group itself when prefill_context_parallel_size is 1."""
    return _groups["cp_kv"]


def get_oproj_gather_group() -> GroupCoordinator:
    """The ranks whose attention-head outputs are concatenated into one o_proj input shard."""
    return _groups["oproj_gather"]


# ---- the tensor-parallel API the layers were written against -------------------------------------

def initialize_tensor_model_parallel(rank: int, world_size: int,
                                     process_group: "torch.distributed.ProcessGroup | None" = None) -> None:
    """Set only the TP group (kept for callers that build a TP world by hand)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor parallel world_size={world_size!r} must be an integer >= 1")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"tensor parallel rank={rank!r} must be an integer in [0, {world_size - 1}]")
    if world_size > 1 and process_group is None:
        raise ValueError(f"tensor parallel world_size={world_size} needs a torch.distributed process group")
    _groups["tp"] = GroupCoordinator(name="tp", rank=rank, world_size=world_size, ranks=list(range(world_size)),
                                     process_group=process_group)


def destroy_tensor_model_parallel() -> None:
    destroy_model_parallel()


def get_tensor_model_parallel_world_size() -> int:
    return _groups["tp"].world_size


def get_tensor_model_parallel_rank() -> int:
    return _groups["tp"].rank


def resolve_tensor_parallel(tp_rank: int | None, tp_size: int | None,
                            group: GroupCoordinator | None = None) -> tuple[int, int]:
    """(rank, size) for a layer: explicit values win (tests simulate ranks that way), else `group`'s
    (default: this process's TP group)."""
    group = group if group is not None else _groups["tp"]
    size = group.world_size if tp_size is None else tp_size
    rank = group.rank if tp_rank is None else tp_rank
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tp_size={size!r} must be an integer >= 1")
    if not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"tp_rank={rank!r} must be an integer in [0, {size - 1}]")
    return rank, size


def tensor_model_parallel_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over the tensor-parallel ranks (identity on one rank)."""
    return _groups["tp"].all_reduce(tensor)


def tensor_model_parallel_all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's `tensor` along `dim` in rank order (identity on one rank)."""
    return _groups["tp"].all_gather(tensor, dim)
