"""FusedMoE: routed experts as one layer — routing, replica mapping, grouped SwiGLU, combine.

Parameters (stacked per local physical slot, loaded from HF per-expert tensors):
    w13_weight [num_local_slots, 2 * intermediate, hidden]   gate rows (shard 'w1') then up rows ('w3')
    w2_weight  [num_local_slots, hidden, intermediate]        down projection (shard 'w2')
`weight_loader(param, loaded_weight, shard_id, expert_id)` writes a logical expert's tensor into every
local slot that holds a replica of it.

Expert parallel (ep_size > 1): the tokens (identical on the ranks of `token_group`, the TP group) are
split into contiguous shards, one per rank of that group; each rank routes its shard, sends every
(token, expert) pair to the rank holding the chosen replica with one all_to_all (dispatch), computes its
local slots, returns the results with a second all_to_all (combine), weights and sums them, and the
shards are all-gathered back into the full output.

EPLB hooks (the layer never imports pagedserve.eplb): `expert_load` counts the tokens routed to each
logical expert (one bincount per forward, into a tensor the load recorder may bind), and
`set_placement(physical_to_logical)` installs a new replica map after the rebalancer moved the weights.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.distributed.parallel_state import GroupCoordinator, get_ep_group, get_tp_group
from pagedserve.layers.moe.expert_placement import identity_placement, replica_map, validate_placement
from pagedserve.layers.moe.fused_experts import fused_experts, group_by_slot, grouped_swiglu_experts
from pagedserve.layers.moe.moe_options import current_moe_options
from pagedserve.layers.moe.router import select_experts
from pagedserve.layers.moe.w8a8_experts import grouped_swiglu_experts_w8a8
from pagedserve.layers.quantization.quantization_context import quantized_experts

SHARD_IDS = ("w1", "w2", "w3")


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        params_dtype: torch.dtype | None = None,
        renormalize: bool = False,
        scoring_func: str = "softmax",
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        group_score: str = "max",
        use_correction_bias: bool = False,
        routed_scaling_factor: float = 1.0,
        num_redundant_experts: int | None = None,
        ep_group: GroupCoordinator | None = None,
        token_group: GroupCoordinator | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        # W8A8 int8 experts when the checkpoint's quantization config quantizes them (an unsupported scheme is
        # refused here, before any parameter exists).
        self.is_quantized = quantized_experts(prefix)
        options = current_moe_options()
        if ep_group is None:
            ep_group = get_ep_group() if options.enable_expert_parallel else GroupCoordinator(name="ep")
            token_group = get_tp_group() if options.enable_expert_parallel else None
        self.ep_group = ep_group
        self.token_group = token_group or GroupCoordinator(name="tokens")
        if num_redundant_experts is None:
            num_redundant_experts = options.num_redundant_experts
        self.prefix = prefix
        self.num_logical_experts = num_experts
        self.num_redundant_experts = num_redundant_experts
        self.num_physical_experts = num_experts + num_redundant_experts
        self.ep_rank, self.ep_size = ep_group.rank, ep_group.world_size
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.scoring_func = scoring_func
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.group_score = group_score
        self.routed_scaling_factor = routed_scaling_factor
        placement = identity_placement(num_experts, num_redundant_experts, self.ep_size)
        self.num_local_slots = self.num_physical_experts // self.ep_size
        dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        weight_dtype = torch.int8 if self.is_quantized else dtype
        self.w13_weight = nn.Parameter(torch.empty(self.num_local_slots, 2 * intermediate_size, hidden_size,
                                                   dtype=weight_dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.num_local_slots, hidden_size, intermediate_size,
                                                  dtype=weight_dtype), requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        if self.is_quantized:
            # Per output channel of each expert, sharded with its rows (compressed-tensors' weight_scale).
            self.w13_weight_scale = nn.Parameter(torch.empty(self.num_local_slots, 2 * intermediate_size, 1,
                                                             dtype=torch.float32), requires_grad=False)
            self.w2_weight_scale = nn.Parameter(torch.empty(self.num_local_slots, hidden_size, 1,
                                                            dtype=torch.float32), requires_grad=False)
            self.w13_weight_scale.weight_loader = self.weight_loader
            self.w2_weight_scale.weight_loader = self.weight_loader
        if use_correction_bias:
            # DeepSeek-V3 / GLM-4.5: a checkpoint buffer, biases the expert *choice* only.
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                        requires_grad=False)
        else:
            self.e_score_correction_bias = None
        # Runtime state, not checkpoint tensors: plain attributes.
        self.physical_to_logical = placement
        self.logical_to_physical, self.replica_counts = replica_map(placement, num_experts)
        self.expert_load = torch.zeros(num_experts, dtype=torch.long)
        self.record_load = True

    # ---- loading --------------------------------------------------------------------------------
    def local_slots_of(self, logical_expert: int) -> list[int]:
        """Local slots of this rank that hold a replica of `logical_expert`."""
        first = self.ep_rank * self.num_local_slots
        local = self.physical_to_logical[first:first + self.num_local_slots]
        return torch.nonzero(local == logical_expert).flatten().tolist()

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str,
                      expert_id: int) -> None:
        if shard_id not in SHARD_IDS:
            raise ValueError(f"{self.prefix}: shard_id={shard_id!r} must be one of {list(SHARD_IDS)}")
        if not 0 <= expert_id < self.num_logical_experts:
            raise ValueError(f"{self.prefix}: expert_id={expert_id} must be in [0, {self.num_logical_experts - 1}]")
        # A weight's columns are the input size; a per-channel scale's single column is 1.
        columns = param.shape[-1]
        if shard_id == "w2":
            expected = (self.hidden_size, columns)
            rows = slice(None)
        else:
            expected = (self.intermediate_size, columns)
            offset = 0 if shard_id == "w1" else self.intermediate_size
            rows = slice(offset, offset + self.intermediate_size)
        field = "weight_scale" if param.dtype == torch.float32 and self.is_quantized else "weight"
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"{self.prefix}: expert {expert_id} {shard_id} {field} has shape "
                             f"{tuple(loaded_weight.shape)}, expected {expected}")
        if self.is_quantized and field == "weight" and loaded_weight.dtype != torch.int8:
            raise ValueError(f"{self.prefix}: expert {expert_id} {shard_id} weight has dtype {loaded_weight.dtype}, "
                             f"but quantization_config quantizes the experts to int8")
        with torch.no_grad():
            for slot in self.local_slots_of(expert_id):
                param[slot, rows].copy_(loaded_weight)

    # ---- placement (EPLB) -------------------------------------------------------------------------
    def expert_tensors(self) -> list[nn.Parameter]:
        """Every per-slot tensor of the experts ([num_local_slots, ...]): what a placement change moves (the
        int8 weights together with their scales)."""
        tensors = [self.w13_weight, self.w2_weight]
        if self.is_quantized:
            tensors += [self.w13_weight_scale, self.w2_weight_scale]
        return tensors

    def set_placement(self, physical_to_logical: torch.Tensor) -> None:
        """Install a new placement; the caller has already put the matching weights into the slots."""
        placement = physical_to_logical.to(torch.long).cpu()
        if placement.numel() != self.num_physical_experts:
            raise ValueError(f"{self.prefix}: placement has {placement.numel()} slots, expected "
                             f"{self.num_physical_experts}")
        validate_placement(placement, self.num_logical_experts, self.ep_size)
        self.physical_to_logical = placement
        self.logical_to_physical, self.replica_counts = replica_map(placement, self.num_logical_experts)

    def bind_expert_load(self, counter: torch.Tensor) -> None:
        """Count into `counter` ([num_logical_experts] int64, e.g. a row of the recorder's table)."""
        if tuple(counter.shape) != (self.num_logical_experts,):
            raise ValueError(f"{self.prefix}: load counter shape {tuple(counter.shape)} != "
                             f"({self.num_logical_experts},)")
        self.expert_load = counter

    # ---- forward --------------------------------------------------------------------------------
    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(
            router_logits, self.top_k, scoring_func=self.scoring_func, renormalize=self.renormalize,
            num_expert_group=self.num_expert_group, topk_group=self.topk_group, group_score=self.group_score,
            e_score_correction_bias=self.e_score_correction_bias,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def physical_ids(self, topk_ids: torch.Tensor, first_token_index: int = 0) -> torch.Tensor:
        """One replica per (token, choice): token t uses replica t mod (replica count), spreading an expert's
        tokens evenly over its replicas. The replicas hold identical weights, so outputs do not depend on it."""
        if self.num_redundant_experts == 0 and self.logical_to_physical.shape[1] == 1:
            return self.logical_to_physical[topk_ids, 0]
        counts = self.replica_counts[topk_ids]
        token_index = torch.arange(first_token_index, first_token_index + topk_ids.shape[0])[:, None]
        return self.logical_to_physical[topk_ids, token_index % counts]

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden_states [n, hidden], router_logits [n, num_experts] -> routed output [n, hidden]."""
        if self.ep_size == 1 and self.token_group.world_size == 1:
            topk_weights, topk_ids = self.route(router_logits)
            self._record(topk_ids)
            slots = self.physical_ids(topk_ids)
            return fused_experts(hidden_states, self.w13_weight, self.w2_weight, topk_weights, slots,
                                 compute_slots=self._compute_slots if self.is_quantized else None)
        return self._forward_expert_parallel(hidden_states, router_logits)

    def _compute_slots(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows sorted by local slot through their slot's expert MLP (unweighted)."""
        if self.is_quantized:
            return grouped_swiglu_experts_w8a8(rows, counts, self.w13_weight, self.w13_weight_scale,
                                               self.w2_weight, self.w2_weight_scale)
        return grouped_swiglu_experts(rows, counts, self.w13_weight, self.w2_weight)

    def _record(self, topk_ids: torch.Tensor) -> None:
        if self.record_load and topk_ids.numel():
            self.expert_load += torch.bincount(topk_ids.reshape(-1), minlength=self.num_logical_experts)

    def _forward_expert_parallel(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        ep, tokens = self.ep_group, self.token_group
        num_tokens = hidden_states.shape[0]
        shard_size = -(-num_tokens // tokens.world_size)
        start = min(tokens.rank * shard_size, num_tokens)
        end = min(start + shard_size, num_tokens)
        shard = hidden_states[start:end]
        topk_weights, topk_ids = self.route(router_logits[start:end])
        self._record(topk_ids)
        physical = self.physical_ids(topk_ids, start).reshape(-1)
        destination = physical // self.num_local_slots
        order = torch.argsort(destination, stable=True)
        send_counts = torch.bincount(destination, minlength=self.ep_size)
        recv_counts = ep.all_to_all_single(send_counts)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        token_of_pair = order // self.top_k
        # Dispatch: the rows and their local slot on the destination rank.
        recv_rows = ep.all_to_all_single(shard.index_select(0, token_of_pair), recv_splits, send_splits)
        recv_slots = ep.all_to_all_single((physical % self.num_local_slots)[order], recv_splits, send_splits)
        slot_order, slot_counts = group_by_slot(recv_slots, self.num_local_slots)
        computed = self._compute_slots(recv_rows.index_select(0, slot_order), slot_counts.tolist())
        expert_out = torch.empty_like(computed)
        expert_out[slot_order] = computed
        # Combine: results travel back along the reverse splits, in the order they were sent.
        returned = ep.all_to_all_single(expert_out, send_splits, recv_splits)
        weights = topk_weights.reshape(-1).index_select(0, order).to(returned.dtype)
        shard_out = torch.zeros(shard_size, self.hidden_size, dtype=hidden_states.dtype,
                                device=hidden_states.device)
        shard_out.index_add_(0, token_of_pair, returned * weights[:, None])
        return tokens.all_gather(shard_out, dim=0)[:num_tokens]

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_logical_experts}, num_redundant={self.num_redundant_experts}, "
                f"top_k={self.top_k}, ep_rank={self.ep_rank}, ep_size={self.ep_size}, "
                f"local_slots={self.num_local_slots}, scoring={self.scoring_func}")
