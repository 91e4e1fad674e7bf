"""PullConnector, worker side: serve this engine's blocks (producer) and pull a producer's blocks (consumer).

Producer: a BlockServer thread answers reads of any block; a request whose blocks the scheduler holds (a "send")
ends when its consumer says done, or free_timeout_s after the worker learnt of it, and is then reported in
finished_sending so that the scheduler frees its blocks.
With several worker ranks (TP, PP; the 'mp' executor) every rank runs its own connector worker side over its own
KV shard (a producer rank serves on its own port); the executor reports a request finished once every rank has
(kv_output_aggregator.py).
Consumer: one loader thread takes the step's load orders in turn: handshake with every producer rank once (block
size, dtypes, model and transport must equal this engine's; their placements and layers give this rank's
KVPullPlan: which producer rank each layer and KV head comes from), read the blocks into the request's blocks
(transport "zmq": the producer rank sends them on its control socket and they are scattered here, whole pages or
head slices; "mooncake": read cache to cache by the Transfer Engine, mooncake_block_transport.py, whole pages only),
tell the producer ranks of this rank's TP group it is done. Every order ends in finished_recving; a failed one also
puts its blocks in invalid_block_ids (the scheduler recomputes or fails the request, per kv_load_failure_policy). A
request that finished in the scheduler meanwhile is cancelled: its blocks are not written (the scheduler holds them
until the order is reported ended, so nothing else can be using them).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import msgspec
import torch
import zmq

from pagedserve.attention.kv_page_layout import KVPageLayout
from pagedserve.config.kv_transfer import KVTransferConfig
from pagedserve.core.scheduler_output import KVConnectorOutput
from pagedserve.kv_transfer.connector_base import KVConnectorWorker
from pagedserve.kv_transfer.kv_page_regions import KVPageRegions, component_descriptions, with_num_heads
from pagedserve.kv_transfer.kv_pull_plan import KVPullPlan, LayerSource, placement_worker_rank
from pagedserve.kv_transfer.mooncake_block_transport import MooncakeEndpoint
from pagedserve.kv_transfer.pull_connector_scheduler import LoadOrder, PullConnectorMetadata
from pagedserve.kv_transfer.zmq_block_transport import (BlockClient, BlockServer, KVTransferError, KVTransferTimeout,
                                                         frames_to_tensors)

logger = logging.getLogger(__name__)


class PullConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, engine_signature: dict[str, Any]) -> None:
        """`engine_signature`: what a peer must share besides the page regions (block size, dtypes, model)."""
        self.config = config
        self.engine_signature = engine_signature
        self.context = zmq.Context()
        self.regions: KVPageRegions | None = None
        self.server: BlockServer | None = None
        self._lock = threading.Lock()
        # Producer: held requests by id -> when their blocks are freed without a done notice.
        self._send_deadlines: dict[str, float] = {}
        self._done_ids: set[str] = set()
        # Done notices received per request, until its number of consumer readers have sent theirs.
        self._done_counts: dict[str, int] = {}
        # Consumer: ended loads and the blocks that did not arrive, until get_finished reports them.
        self._finished_loads: set[str] = set()
        self._invalid_block_ids: set[int] = set()
        self._cancelled_ids: set[str] = set()
        self._pending_ids: set[str] = set()
        self._orders: queue.Queue[LoadOrder | None] = queue.Queue()
        # Cumulative KV bytes loaded and the seconds their reads took (request sent to blocks written).
        self.num_loaded_bytes = 0
        self.load_seconds = 0.0
        self._loader: threading.Thread | None = None
        self.mooncake: MooncakeEndpoint | None = None

    @property
    def port(self) -> int:
        """The port this producer's block server listens on (0 for a consumer)."""
        return self.server.port if self.server is not None else 0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], page_layouts: dict[str, KVPageLayout],
                           num_blocks: int) -> None:
        transport = self.config.extra("transport")
        self.regions = KVPageRegions.build(kv_caches, page_layouts, num_blocks,
                                           self.engine_signature | {"transport": transport})
        handshake_extra = {}
        if transport == "mooncake":
            self.mooncake = MooncakeEndpoint(self.regions, self.config.extra("host"))
            handshake_extra["mooncake"] = self.mooncake.descriptor()
        if self.config.is_producer:
            port = self.config.worker_kv_port(placement_worker_rank(self.engine_signature))
            self.server = BlockServer(self.context, self.config.extra("host"), port, self.regions,
                                      self._on_done, handshake_extra)
        if self.config.is_consumer:
            self._loader = threading.Thread(target=self._load_orders, name="pagedserve-kv-loader", daemon=True)
            self._loader.start()

    # ---- producer ----------------------------------------------------------------------------------------------
    def _on_done(self, request_id: str, num_readers: int) -> None:
        with self._lock:
            count = self._done_counts.get(request_id, 0) + 1
            if count >= num_readers:
                self._done_counts.pop(request_id, None)
                self._done_ids.add(request_id)
            else:
                self._done_counts[request_id] = count

    # ---- the step ----------------------------------------------------------------------------------------------
    def start_load_kv(self, metadata: Any) -> None:
        if isinstance(metadata, dict):  # from a worker process: the step's msgpack brings it as a plain map
            metadata = msgspec.convert(metadata, PullConnectorMetadata)
        if not isinstance(metadata, PullConnectorMetadata):
            return
        now = time.monotonic()
        with self._lock:
            for request_id in metadata.sends:
                self._send_deadlines[request_id] = now + float(self.config.extra("free_timeout_s"))
            self._pending_ids.update(order.request_id for order in metadata.loads)
            self._cancelled_ids.update(self._pending_ids.intersection(metadata.finished_request_ids))
        for order in metadata.loads:
            self._orders.put(order)

    def wait_for_save(self) -> None:
        # Pull mode: the blocks are read from the cache as they are; nothing to wait for.
        return None

    def get_finished(self, finished_request_ids: set[str]) -> KVConnectorOutput:
        now = time.monotonic()
        with self._lock:
            # A done notice may come before the worker learns of the send: the scheduler frees only what it holds.
            finished_sending = set(self._done_ids)
            self._done_ids.clear()
            for request_id, deadline in list(self._send_deadlines.items()):
                if request_id in finished_sending or deadline <= now:
                    if request_id not in finished_sending:
                        logger.warning("request %s: no consumer fetched its KV within free_timeout_s=%g; freeing "
                                       "its blocks", request_id, self.config.extra("free_timeout_s"))
                    finished_sending.add(request_id)
                    del self._send_deadlines[request_id]
                    self._done_counts.pop(request_id, None)
            output = KVConnectorOutput(finished_sending=finished_sending, finished_recving=self._finished_loads,
                                       invalid_block_ids=self._invalid_block_ids)
            self._finished_loads, self._invalid_block_ids = set(), set()
        return output

    # ---- consumer ----------------------------------------------------------------------------------------------
    def _load_orders(self) -> None:
        client = BlockClient(self.context, float(self.config.extra("transfer_timeout_s")))
        # Producer ranks handshaken with, by (host, port) -> their handshake answer.
        verified: dict[tuple[str, int], dict[str, Any]] = {}
        try:
            while True:
                order = self._orders.get()
                if order is None:
                    return
                if not order.remote_ports:
                    order.remote_ports = [order.remote_port]
                is_loaded, is_reachable, plan = False, True, None
                try:
                    answers = [self._handshake(client, order.remote_host, port, verified)
                               for port in order.remote_ports]
                    plan = self._plan(order, answers)
                    is_loaded = self._load(client, order, plan, answers)
                except KVTransferTimeout as error:
                    is_reachable = False
                    logger.error("request %s: KV load from %s:%d failed (kv_load_failure_policy=%s): %s",
                                 order.request_id, order.remote_host, order.remote_port,
                                 self.config.kv_load_failure_policy, error)
                except KVTransferError as error:
                    logger.error("request %s: KV load from %s:%d failed (kv_load_failure_policy=%s): %s",
                                 order.request_id, order.remote_host, order.remote_port,
                                 self.config.kv_load_failure_policy, error)
                except Exception:
                    logger.exception("request %s: KV load failed", order.request_id)
                if is_reachable:
                    self._notify_done(client, order, plan)
                self._report_load_ended(order, is_loaded)
        finally:
            client.close()

    def _report_load_ended(self, order: LoadOrder, is_loaded: bool) -> None:
        """`order`'s load ended: reported in the next finished_recving, its blocks in invalid_block_ids unless every
        one arrived. Caller holds no lock."""
        with self._lock:
            self._pending_ids.discard(order.request_id)
            self._cancelled_ids.discard(order.request_id)
            self._finished_loads.add(order.request_id)
            if not is_loaded:
                self._invalid_block_ids.update(order.local_block_ids)

    def _plan(self, order: LoadOrder, answers: list[dict[str, Any]]) -> KVPullPlan:
        """Where this rank's layers come from (KVTransferError naming both sides when the engines differ)."""
        assert self.regions is not None
        try:
            return KVPullPlan.build(self.regions.signature, [answer.get("signature") or {} for answer in answers])
        except KVTransferError as error:
            ports = order.remote_ports[0] if len(order.remote_ports) == 1 else order.remote_ports
            raise KVTransferError(f"handshake with engine {order.remote_engine_id!r} at {order.remote_host}:"
                                  f"{ports}: {error}") from None

    def _load(self, client: BlockClient, order: LoadOrder, plan: KVPullPlan, answers: list[dict[str, Any]]) -> bool:
        """Pull one order's blocks per `plan`; False when it was cancelled before its blocks were written."""
        assert self.regions is not None
        # After the handshake, so that a block size mismatch is reported as such.
        if len(order.remote_block_ids) != len(order.local_block_ids):
            raise KVTransferError(f"the producer holds {len(order.remote_block_ids)} blocks for positions this "
                                  f"engine keeps in {len(order.local_block_ids)} (remote_block_ids does not cover "
                                  f"the prompt)")
        if self._is_cancelled(order.request_id):
            return False
        start = time.perf_counter()
        num_bytes = 0
        for rank, remote_layers in plan.remote_layers.items():
            sources = [source for source in plan.sources if source.remote_rank == rank]
            if self.mooncake is not None:
                num_bytes += self._read_mooncake(order, answers[rank], sources)
                continue
            remote_signature = answers[rank]["signature"]
            region_counts = [len(remote_signature["layers"][index][1]) for index in remote_layers]
            _, frames = client.call(order.remote_host, order.remote_ports[rank],
                                    {"kind": "read", "block_ids": order.remote_block_ids, "layers": remote_layers})
            region_bytes = [size for index in remote_layers for size in remote_signature["layers"][index][1]]
            tensors = frames_to_tensors(frames, len(order.local_block_ids), region_bytes)
            # Each remote layer's frames, by remote layer index.
            by_layer: dict[int, list[torch.Tensor]] = {}
            cursor = 0
            for index, count in zip(remote_layers, region_counts):
                by_layer[index] = tensors[cursor:cursor + count]
                cursor += count
            if self._is_cancelled(order.request_id):
                return False
            for source in sources:
                self._write_source(source, order.local_block_ids, by_layer[source.remote_layer], remote_signature)
            num_bytes += sum(tensor.numel() for tensor in tensors)
        seconds = time.perf_counter() - start
        with self._lock:
            self.num_loaded_bytes += num_bytes
            self.load_seconds += seconds
        logger.debug("request %s: loaded %d blocks (%.1f MiB) in %.3f s", order.request_id,
                     len(order.local_block_ids), num_bytes / 2**20, seconds)
        return True

    def _write_source(self, source: LayerSource, local_block_ids: list[int], layer_frames: list[torch.Tensor],
                      remote_signature: dict[str, Any]) -> None:
        """Write one source's pages (its remote layer's regions, [len(local_block_ids), region bytes] each) into
        `local_block_ids`: whole pages, or its head slice."""
        assert self.regions is not None
        if source.is_whole_page:
            self.regions.scatter(local_block_ids, layer_frames, [source.local_layer])
        else:
            self.regions.copy_heads(source.local_layer, local_block_ids, self._remote_layout(source, remote_signature),
                                    layer_frames, source.remote_head_start, source.local_head_start, source.num_heads)

    @staticmethod
    def _handshake(client: BlockClient, host: str, port: int,
                   verified: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
        """One producer rank's handshake answer (asked once per host and port)."""
        endpoint = (host, port)
        if endpoint not in verified:
            verified[endpoint], _ = client.call(*endpoint, {"kind": "handshake"})
        return verified[endpoint]

    def _remote_layout(self, source: LayerSource, remote_signature: dict[str, Any]) -> KVPageLayout:
        """The producer rank's page layout of a head-sliced layer: this rank's with its number of KV heads
        (KVTransferError when its components say otherwise)."""
        assert self.regions is not None
        layout = with_num_heads(self.regions.layouts[source.local_layer], source.remote_num_heads)
        remote_entry = remote_signature["layers"][source.remote_layer]
        if component_descriptions(layout) != remote_entry[2]:
            raise KVTransferError(f"layer {remote_entry[0]!r}: the producer's page holds {remote_entry[2]}, this "
                                  f"engine expects {component_descriptions(layout)} for {source.remote_num_heads} "
                                  f"KV heads")
        return layout

    def _read_mooncake(self, order: LoadOrder, answer: dict[str, Any], sources: list[LayerSource]) -> int:
        """Whole pages of `sources`' layers from one producer rank, cache to cache."""
        assert self.regions is not None and self.mooncake is not None
        if any(not source.is_whole_page for source in sources):
            raise KVTransferError("transport 'mooncake' reads whole pages: a producer whose tensor parallel "
                                  "split differs from this engine's needs transport 'zmq' (head slices)")
        remote_layers = answer["signature"]["layers"]
        local_offsets = _region_offsets([len(regions) for regions in self.regions.regions])
        remote_offsets = _region_offsets([len(entry[1]) for entry in remote_layers])
        pairs = [(local_offsets[source.local_layer] + region, remote_offsets[source.remote_layer] + region)
                 for source in sources for region in range(len(self.regions.regions[source.local_layer]))]
        # Written in place; a request cancelled meanwhile still holds these blocks until the order ends.
        return self.mooncake.read(answer.get("mooncake") or {}, order.remote_block_ids, order.local_block_ids,
                                  pairs)

    def _notify_done(self, client: BlockClient, order: LoadOrder, plan: KVPullPlan | None) -> None:
        """Tell the producer ranks of this rank's TP group to free the request's blocks (they free them after
        free_timeout_s anyway). Without a plan (the handshake failed) every producer rank is told, as one
        reader: nothing was read."""
        ranks = plan.done_ranks if plan is not None else range(len(order.remote_ports))
        num_readers = plan.num_readers if plan is not None else 1
        for rank in ranks:
            try:
                client.call(order.remote_host, order.remote_ports[rank],
                            {"kind": "done", "request_id": order.remote_request_id, "num_readers": num_readers})
            except KVTransferError as error:
                logger.warning("request %s: could not tell producer rank %d it is done: %s", order.request_id, rank,
                               error)

    def _is_cancelled(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._cancelled_ids

    def shutdown(self) -> None:
        is_joined = True
        if self._loader is not None:
            self._orders.put(None)
            self._loader.join(timeout=float(self.config.extra("transfer_timeout_s")) * 2 + 1)
            is_joined = not self._loader.is_alive()
            self._loader = None
        if self.server is not None:
            self.server.shutdown()
            self.server = None
        if self.mooncake is not None and is_joined:
            self.mooncake.close()
            self.mooncake = None
        if is_joined:
            self.context.term()
        else:  # a loader still waiting on a dead producer (a daemon thread): close its socket rather than hang
            self.context.destroy(linger=0)


def _region_offsets(region_counts: list[int]) -> list[int]:
    """Each layer's first index in the flat region list, from the layers' region counts."""
    offsets, total = [], 0
    for count in region_counts:
        offsets.append(total)
        total += count
    return offsets
