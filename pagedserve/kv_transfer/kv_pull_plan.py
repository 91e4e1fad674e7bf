"""Which producer rank each of this consumer rank's layers (and heads) comes from: the kv pp and unequal TP map.

A producer (P) with several worker ranks serves each rank's own KV shard on its own port. Each rank's handshake
answer names its placement (tp_rank, tp_size, pp_rank, pp_size) and, per layer it holds, the layer's regions and
its KV head interval ([first head, heads, total heads] of a dense K/V layer; None for a replicated cache: MLA
latents, which every TP rank holds whole). From those answers a consumer rank plans, per local layer:
- kv pp: the layer comes from a P rank whose pipeline stage holds it (layer names are global, `model.layers.N`),
  so P's layer partition is read from the handshakes, whatever it is;
- unequal TP (vLLM-Ascend's head-interval mapping): each local KV head comes from a P rank whose head interval
  holds it. One tensor_parallel_size must be a multiple of the other. P with more ranks (ratio = P_tp / D_tp): the
  P ranks of this rank's TP group (P tp ranks [d * ratio, (d + 1) * ratio)) are preferred, so equal TP reads rank
  to rank and a replicated cache is read from one P rank of the group. D with more ranks (share = D_tp / P_tp): D
  rank d reads the slice of its heads from P tp rank d // share, and a replicated cache (MLA latents) whole from
  it. KV heads replicated over TP ranks (num_key_value_heads < tp) are intervals of one head that several ranks
  share; any of them serves.
A layer whose source covers exactly its heads with the same page is copied as whole pages (byte regions); else
each source's head range is copied into the local heads' slice of the page (views, zmq transport only).

Done notices (P frees a request's blocks once every P rank reported it, kv_output_aggregator.py): every consumer
rank tells every P rank of its TP group, after its own reads; each P rank waits for as many notices as consumer
ranks read it (`num_readers`: the consumer's pipeline stages, times D_tp / P_tp when D has more TP ranks), so no P
rank frees blocks a consumer rank may still read.
Pure Python on the handshake answers (unit-testable).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.kv_transfer.kv_page_regions import signature_mismatches
from pagedserve.kv_transfer.zmq_block_transport import KVTransferError

# Handshake signature keys that differ between the ranks of one engine (compared by the plan, not for equality).
PLACEMENT_KEYS = ("tp_rank", "tp_size", "pp_rank", "pp_size", "layers")


@dataclass(frozen=True)
class LayerSource:
    """Local layer `local_layer` (index in this rank's layer list) gets `num_heads` heads from producer rank
    `remote_rank`'s layer `remote_layer`: its heads from `remote_head_start` into the local heads from
    `local_head_start`. `num_heads` 0: the whole page, byte for byte."""

    local_layer: int
    remote_rank: int
    remote_layer: int
    num_heads: int = 0
    local_head_start: int = 0
    remote_head_start: int = 0
    remote_num_heads: int = 0  # heads the producer rank's page holds (for its page layout)

    @property
    def is_whole_page(self) -> bool:
        return self.num_heads == 0


@dataclass
class KVPullPlan:
    """One consumer rank's sources for every local layer, and the producer ranks it sends done notices to."""

    sources: list[LayerSource]
    done_ranks: list[int]
    num_readers: int
    # Producer rank -> the remote layer indices to read from it (sorted).
    remote_layers: dict[int, list[int]] = field(default_factory=dict)

    @staticmethod
    def build(local: dict[str, Any], remotes: list[dict[str, Any]]) -> "KVPullPlan":
        """`local`: this rank's handshake signature; `remotes`: each producer rank's (rank order). KVTransferError
        naming both sides when they cannot be paired."""
        common_local = {key: value for key, value in local.items() if key not in PLACEMENT_KEYS}
        for rank, remote in enumerate(remotes):
            common_remote = {key: value for key, value in remote.items() if key not in PLACEMENT_KEYS}
            mismatches = signature_mismatches(common_local, common_remote)
            if mismatches:
                raise KVTransferError("the engines' KV caches differ: " + "; ".join(mismatches)
                                      + (f" (producer rank {rank})" if len(remotes) > 1 else ""))
        local_tp, remote_tp = int(local.get("tp_size", 1)), int(remotes[0].get("tp_size", 1))
        local_tp_rank = int(local.get("tp_rank", 0))
        if remote_tp % local_tp and local_tp % remote_tp:
            raise KVTransferError(f"tensor_parallel_size: producer {remote_tp}, consumer {local_tp}: one must be a "
                                  f"multiple of the other (each consumer rank reads whole producer head intervals, "
                                  f"or a slice of one)")
        if remote_tp >= local_tp:
            # This rank's heads are spread over `ratio` producer ranks; each producer rank has one reader per stage.
            ratio = remote_tp // local_tp
            group = range(local_tp_rank * ratio, (local_tp_rank + 1) * ratio)
            readers_per_stage = 1
        else:
            # `share` consumer ranks slice the heads of one producer rank (or, MLA, each reads its whole latent):
            # that producer rank waits for a done notice from every one of them.
            share = local_tp // remote_tp
            group = range(local_tp_rank // share, local_tp_rank // share + 1)
            readers_per_stage = share
        holders: dict[str, list[tuple[int, int, list[Any]]]] = {}
        for rank, remote in enumerate(remotes):
            for layer_index, entry in enumerate(remote.get("layers") or []):
                holders.setdefault(entry[0], []).append((rank, layer_index, entry))

        def preference(holder: tuple[int, int, list[Any]]) -> tuple[bool, int]:
            return int(remotes[holder[0]].get("tp_rank", 0)) not in group, holder[0]

        sources: list[LayerSource] = []
        for local_index, entry in enumerate(local.get("layers") or []):
            name = entry[0]
            candidates = sorted(holders.get(name, []), key=preference)
            if not candidates:
                # A hidden-state drafter's pages travel beside the target's (kv_transfer/connector_factory.py).
                drafter_hint = (": this engine's speculative drafter reads its KV over the prompt from the producer, "
                                "which must run the same speculative_config") if name.startswith("drafter.") else ""
                raise KVTransferError(f"layer {name!r}: no producer rank holds it (producer layers: "
                                      f"{sorted(holders)[:4]}...){drafter_hint}")
            sources += _layer_sources(local_index, entry, candidates)
        remote_layers: dict[int, set[int]] = {}
        for source in sources:
            remote_layers.setdefault(source.remote_rank, set()).add(source.remote_layer)
        done_ranks = [rank for rank, remote in enumerate(remotes) if int(remote.get("tp_rank", 0)) in group]
        return KVPullPlan(sources, done_ranks, int(local.get("pp_size", 1)) * readers_per_stage,
                          {rank: sorted(layers) for rank, layers in sorted(remote_layers.items())})


def placement_worker_rank(placement: dict[str, Any]) -> int:
    """A worker's rank in its engine from its placement (connector_factory.kv_placement): pp_rank * tp_size +
    tp_rank, the order of a producer's remote_ports (0 without a placement)."""
    return int(placement.get("pp_rank", 0)) * int(placement.get("tp_size", 1)) + int(placement.get("tp_rank", 0))


def _layer_sources(local_index: int, entry: list[Any], candidates: list[tuple[int, int, list[Any]]]
                   ) -> list[LayerSource]:
    """The sources of one local layer from the producer ranks holding it (preferred first)."""
    name, local_heads = entry[0], _heads(entry)
    if local_heads is None:  # replicated (MLA): the preferred holder's page, whole
        rank, remote_index, remote_entry = candidates[0]
        _check_same_page(name, entry, remote_entry)
        return [LayerSource(local_index, rank, remote_index)]
    first, count, total = local_heads
    sources: list[LayerSource] = []
    head = first
    while head < first + count:
        holder = next(((rank, index, remote_entry) for rank, index, remote_entry in candidates
                       if _covers(remote_entry, head, total)), None)
        if holder is None:
            raise KVTransferError(f"layer {name!r}: no producer rank holds KV head {head} of {total}")
        rank, remote_index, remote_entry = holder
        remote_first, remote_count, _ = _heads(remote_entry)  # type: ignore[misc]
        num_heads = min(first + count, remote_first + remote_count) - head
        sources.append(LayerSource(local_index, rank, remote_index, num_heads, head - first, head - remote_first,
                                   remote_count))
        head += num_heads
    if len(sources) == 1 and sources[0].num_heads == count == sources[0].remote_num_heads:
        # The producer rank holds exactly these heads: its page is this page (the remote_entry of the one source).
        _check_same_page(name, entry, remote_entry)
        return [LayerSource(local_index, sources[0].remote_rank, sources[0].remote_layer)]
    return sources


def _heads(entry: list[Any]) -> list[int] | None:
    """A signature layer entry's [first head, heads, total heads] (None: replicated over TP ranks)."""
    return entry[3] if len(entry) > 3 else None


def _covers(entry: list[Any], head: int, total: int) -> bool:
    heads = _heads(entry)
    if heads is None or heads[2] != total:
        return False
    return heads[0] <= head < heads[0] + heads[1]


def _check_same_page(name: str, local: list[Any], remote: list[Any]) -> None:
    if local[1:3] != remote[1:3]:
        raise KVTransferError(f"layer {name!r}: the engines' pages differ: producer {remote[1:3]}, consumer "
                              f"{local[1:3]}")


__all__ = ["KVPullPlan", "LayerSource", "PLACEMENT_KEYS", "placement_worker_rank"]
