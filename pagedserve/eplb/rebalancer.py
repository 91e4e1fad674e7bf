"""Moving expert weights into a new placement, then switching the layer's replica map.

Every rank computes the same plan from (old placement, new placement). For each local slot of the new
placement: if this rank already holds the expert (in any old slot) it is a local copy; otherwise the
expert's weights come point-to-point from a source rank — a rank that held it before, preferring one that
drops it — with one batch of isend/irecv over the EP group. Weights are read from a snapshot of the old
slots, so moves within a rank may permute freely. The replicas are exact copies, so a rebalance never
changes what the layer computes.
"""
from __future__ import annotations

import torch
import torch.distributed


def transfer_sources(old: list[list[int]], new: list[list[int]]) -> dict[tuple[int, int], int]:
    """(destination rank, logical expert) -> source rank, for every expert a rank gains."""
    sources: dict[tuple[int, int], int] = {}
    for rank, experts in enumerate(new):
        for expert in experts:
            if expert in old[rank] or (rank, expert) in sources:
                continue
            holders = [r for r, row in enumerate(old) if expert in row]
            dropping = [r for r in holders if expert not in new[r]]
            sources[(rank, expert)] = (dropping or holders)[0]
    return sources


@torch.no_grad()
def move_expert_weights(layer, new_placement: torch.Tensor) -> None:
    """Fill `layer`'s local slots for `new_placement` and install it (the layer's placement switches last)."""
    ep_size, slots = layer.ep_size, layer.num_local_slots
    rank = layer.ep_rank
    old_rows = layer.physical_to_logical.reshape(ep_size, slots).tolist()
    new_rows = new_placement.to(torch.long).reshape(ep_size, slots).tolist()
    # Every per-slot tensor moves: the weights, and the scales of quantized experts (layer.expert_tensors()).
    tensors = layer.expert_tensors()
    old_tensors = [tensor.detach().clone() for tensor in tensors]
    sources = transfer_sources(old_rows, new_rows)
    operations = []
    receives: list[tuple[int, list[torch.Tensor]]] = []
    group = layer.ep_group
    for (destination, expert), source in sorted(sources.items()):
        if source == rank and destination != rank:
            slot = old_rows[rank].index(expert)
            for old in old_tensors:
                operations.append(torch.distributed.P2POp(torch.distributed.isend, old[slot].contiguous(),
                                                          group.ranks[destination], group.process_group))
        elif destination == rank:
            buffers = [torch.empty_like(old[0]) for old in old_tensors]
            for tensor in buffers:
                operations.append(torch.distributed.P2POp(torch.distributed.irecv, tensor,
                                                          group.ranks[source], group.process_group))
            receives.append((expert, buffers))
    if operations:
        for request in torch.distributed.batch_isend_irecv(operations):
            request.wait()
    received = dict(receives)
    for slot, expert in enumerate(new_rows[rank]):
        if expert in old_rows[rank]:
            old_slot = old_rows[rank].index(expert)
            sources_of_slot = [old[old_slot] for old in old_tensors]
        else:
            sources_of_slot = received[expert]
        for tensor, source_tensor in zip(tensors, sources_of_slot):
            tensor[slot].copy_(source_tensor)
    layer.set_placement(new_placement)
