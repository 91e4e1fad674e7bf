"""PullConnector in push mode (kv_connector_extra_config.mode "push"), worker side: P sends each layer's KV of a
request as soon as the layer's forward wrote it, into blocks D reserved; the transfer overlaps P's remaining layers.

The flow (the anchors' layer-wise connectors do the same: D allocates first and tells P where, P writes per layer):
1. D is sent the request first, with kv_transfer_params naming P (remote_host, remote_port, remote_engine_id) and the
   id P will run it under (remote_request_id); remote_block_ids may be empty. D's scheduler reserves blocks for the
   whole prompt and parks the request in WAITING_FOR_REMOTE_KVS (push_connector_scheduler.py).
2. D's receiver thread handshakes with P (the pull mode's checks, plus: P runs mode "push"), then sends P a
   "push_order" on a stream connection to P's block server: P's request id, D's request id (the tag every answer
   carries), D's block ids by position (from `first_block`: D's own prefix hit is not sent) and the layers it wants.
3. P runs the request (with do_remote_decode, max_tokens 1). Each step's SaveOrders (scheduler side) name the blocks
   the step writes; in the forward every attention layer calls save_kv_layer once its KV is written, and P queues
   that layer's pages of those blocks for every consumer that ordered them (gathered views: zero-copy where the
   blocks are consecutive). The block server thread forwards the queue to D (its one ROUTER socket); D scatters each
   layer's pages into its blocks as they come.
4. After the step that completes the prompt P sends "complete"; D then reports the load ended (finished_recving),
   the request computes its last prompt token and decodes, and D tells P it is done (P frees its blocks).
An order that reaches P before P computed the request waits; one that reaches P mid-prefill is activated at the next
step boundary with a catch-up of the blocks already written (all layers); one that reaches P after the prefill gets
everything at once (no overlap then: that is pull mode's timing). A block written partly by one chunk is sent again
by the next, and messages to one consumer keep their order, so the last copy D writes is the final one.

Failures: D fails a load (its blocks go to invalid_block_ids: recompute or fail per kv_load_failure_policy) when P
refuses the order, sends "failed" (P aborted the request, or the order waited free_timeout_s for a request P never
got), or sends nothing for transfer_timeout_s (P died or never ran the request). A request aborted on D cancels its
load (nothing more is written; P is told it is done). P frees its blocks on D's done notice or after free_timeout_s.
One worker rank a side for now (config/kv_transfer.py refuses TP / PP > 1 in push mode).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import zmq

from pagedserve.attention.kv_page_layout import KVPageLayout
from pagedserve.config.kv_transfer import KVTransferConfig
from pagedserve.core.scheduler_output import KVConnectorOutput
from pagedserve.kv_transfer.kv_page_regions import KVPageRegions
from pagedserve.kv_transfer.kv_pull_plan import KVPullPlan, LayerSource, placement_worker_rank
from pagedserve.kv_transfer.pull_connector_scheduler import LoadOrder
from pagedserve.kv_transfer.pull_connector_worker import PullConnectorWorker
from pagedserve.kv_transfer.push_connector_scheduler import PushConnectorMetadata, SaveOrder
from pagedserve.kv_transfer.zmq_block_transport import (BlockClient, BlockServer, KVTransferError, KVTransferTimeout,
                                                         frames_to_tensors)

logger = logging.getLogger(__name__)

# How long the consumer's receiver waits for a message before it looks at new orders, cancellations and deadlines.
_RECEIVE_POLL_MS = 5


@dataclass
class _Destination:
    """Where one consumer wants a producer request's pages: `block_ids` (the consumer's) hold positions
    first_block, first_block + 1, ...; `layers`: indices of this rank's layers it reads."""

    identity: bytes
    tag: str
    block_ids: list[int]
    first_block: int
    layers: set[int]
    arrived: float = 0.0


@dataclass
class _PushedRequest:
    """A producer request with do_remote_decode: its blocks by position, the prompt tokens whose KV is written in
    every layer, and the consumers its pages stream to."""

    block_ids: list[int] = field(default_factory=list)
    num_written_tokens: int = 0
    is_prefilled: bool = False
    destinations: list[_Destination] = field(default_factory=list)


@dataclass
class _PushLoad:
    """A consumer load in flight: the order, its plan, the producer ranks yet to send "complete"."""

    order: LoadOrder
    plan: KVPullPlan
    answers: list[dict[str, Any]]
    sources: dict[tuple[int, int], list[LayerSource]]
    pending_ranks: set[int]
    deadline: float
    started: float
    num_bytes: int = 0
    # The push order's sequence number: a producer's refusal answers with it.
    sequence: int = 0
    # (producer rank, its layer index) -> block positions written so far: "complete" is taken only when every
    # ordered layer covers every ordered position (a layer the producer failed to send fails the load, loudly).
    received: dict[tuple[int, int], set[int]] = field(default_factory=dict)


class PushConnectorWorker(PullConnectorWorker):
    """The pull connector's worker side with the push mode's producer stream and consumer receiver."""

    def __init__(self, config: KVTransferConfig, engine_signature: dict[str, Any]) -> None:
        super().__init__(config, engine_signature)
        self._encoder = msgspec.msgpack.Encoder()
        # Producer: requests with do_remote_decode by id, and orders that arrived before their request could take
        # them (not yet seen, or mid-step). Guarded by self._lock (the server thread reads and adds).
        self._pushed: dict[str, _PushedRequest] = {}
        self._waiting_orders: dict[str, list[_Destination]] = {}
        # This step's SaveOrders with at least one destination: request id -> (first block, end block) it writes.
        self._step_blocks: dict[str, tuple[int, int]] = {}
        self._step_saves: list[SaveOrder] = []
        self._layer_by_pointer: dict[int, int] = {}
        self._outbox: zmq.Socket | None = None
        # Layer messages sent from save_kv_layer during a forward, and pages sent in catch-ups (orders that came
        # after some of their blocks were written): the tests tell the layer-wise path from the catch-up by them.
        self.num_layer_sends = 0
        self.num_catch_up_sends = 0
        # Consumer (receiver thread only): push orders sent, and which load each sequence number belongs to.
        self._push_sequence = 0
        self._sequence_tags: dict[int, str] = {}

    @property
    def saves_kv_per_layer(self) -> bool:
        return self.config.is_producer

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], page_layouts: dict[str, KVPageLayout],
                           num_blocks: int) -> None:
        self.regions = KVPageRegions.build(kv_caches, page_layouts, num_blocks,
                                           self.engine_signature | {"transport": self.config.extra("transport")})
        # The layers find their index by their cache's address (the bound cache is the registered primary view).
        self._layer_by_pointer = {cache.data_ptr(): index for index, cache in enumerate(kv_caches.values())}
        if self.config.is_producer:
            outbox_address = f"inproc://pagedserve-kv-push-{uuid.uuid4().hex}"
            port = self.config.worker_kv_port(placement_worker_rank(self.engine_signature))
            self.server = BlockServer(self.context, self.config.extra("host"), port, self.regions,
                                      self._on_done, {"mode": "push"}, {"push_order": self._on_push_order},
                                      outbox_address)
            # Used by the forward thread only (save_kv_layer, wait_for_save, get_finished): zmq sockets are not
            # thread-safe, the server thread forwards what it queues.
            self._outbox = self.context.socket(zmq.PUSH)
            self._outbox.setsockopt(zmq.LINGER, 0)
            self._outbox.connect(outbox_address)
        if self.config.is_consumer:
            self._loader = threading.Thread(target=self._receive, name="pagedserve-kv-push-receiver", daemon=True)
            self._loader.start()

    # ---- producer ----------------------------------------------------------------------------------------------
    def _on_push_order(self, identity: bytes, header: dict[str, Any]) -> list[list[Any]]:
        """The server thread's handler of a consumer's push_order; returns what to send it now (everything, when
        the request's prompt is already written), else nothing (the forward thread activates the order)."""
        assert self.regions is not None
        request_id, tag = header.get("request_id"), header.get("tag")
        block_ids, first_block, layers = header.get("block_ids"), header.get("first_block"), header.get("layers")
        num_layers = len(self.regions.regions)
        if not isinstance(request_id, str) or not request_id or not isinstance(tag, str) or not tag:
            raise KVTransferError(f"push_order: request_id={request_id!r} and tag={tag!r} must be non-empty strings")
        if not isinstance(block_ids, list) or not all(isinstance(block_id, int) and block_id >= 0
                                                      for block_id in block_ids):
            raise KVTransferError(f"push_order: block_ids={block_ids!r} must be a list of integers >= 0")
        if not isinstance(first_block, int) or first_block < 0:
            raise KVTransferError(f"push_order: first_block={first_block!r} must be an integer >= 0")
        if not isinstance(layers, list) or not all(isinstance(index, int) and 0 <= index < num_layers
                                                   for index in layers):
            raise KVTransferError(f"push_order: layers={layers!r} must be layer indices in [0, {num_layers - 1}]")
        destination = _Destination(identity, tag, list(block_ids), first_block, set(layers), time.monotonic())
        with self._lock:
            state = self._pushed.get(request_id)
            if state is None or not state.is_prefilled:
                self._waiting_orders.setdefault(request_id, []).append(destination)
                return []
            block_ids_now, num_written = list(state.block_ids), state.num_written_tokens
        # Written and held for consumers: its blocks no longer change, so everything goes now.
        messages = self._catch_up_messages(block_ids_now, num_written, destination)
        return [message[1:] for message in messages] + [self._control(destination, "complete")[1:]]

    def start_load_kv(self, metadata: Any) -> None:
        if isinstance(metadata, dict):  # from a worker process: the step's msgpack brings it as a plain map
            metadata = msgspec.convert(metadata, PushConnectorMetadata)
        super().start_load_kv(metadata)
        if not isinstance(metadata, PushConnectorMetadata) or not self.config.is_producer:
            return
        with self._lock:
            # Ended without their KV (aborted, failed): tell their consumers, then release the blocks the scheduler
            # holds for them (reported in finished_sending; pages still queued come before "failed" to D).
            for request_id in metadata.aborted:
                state = self._pushed.pop(request_id, None)
                orders = self._waiting_orders.pop(request_id, [])
                for destination in (state.destinations if state is not None else []) + orders:
                    self._send(self._control(destination, "failed",
                                             error=f"the producer's request {request_id!r} ended without its KV"))
                self._done_ids.add(request_id)
            for save in metadata.saves:
                state = self._pushed.setdefault(save.request_id, _PushedRequest())
                # Tokens before the step are written in every layer (a prefix hit, earlier chunks); a preempted
                # request comes again from 0 in new blocks.
                state.block_ids, state.num_written_tokens = save.block_ids, save.num_tokens_before
                state.is_prefilled = False
            self._step_saves = list(metadata.saves)
        self._activate_waiting_orders()
        block_size = self.engine_signature["block_size"]
        self._step_blocks = {save.request_id: (save.num_tokens_before // block_size,
                                               -(-save.num_tokens_after // block_size))
                             for save in self._step_saves if self._pushed[save.request_id].destinations}

    def save_kv_layer(self, layer_name: str, kv_cache: torch.Tensor) -> None:
        if not self._step_blocks:
            return
        layer_index = self._layer_by_pointer.get(kv_cache.data_ptr())
        if layer_index is None:  # a layer the connector does not move
            return
        for request_id, (first, end) in self._step_blocks.items():
            state = self._pushed[request_id]
            for destination in state.destinations:
                if layer_index in destination.layers:
                    message = self._layer_message(state.block_ids, destination, layer_index, first, end)
                    if message is not None:
                        self._send(message)
                        self.num_layer_sends += 1

    def wait_for_save(self) -> None:
        # The layers' pages are queued (the server thread sends them); what remains is to mark the step's tokens
        # written and to tell the consumers of completed prompts.
        if not self.config.is_producer:
            return
        with self._lock:
            completed = []
            for save in self._step_saves:
                state = self._pushed.get(save.request_id)
                if state is None:
                    continue
                state.num_written_tokens = save.num_tokens_after
                if save.completes_prompt:
                    state.is_prefilled = True
                    completed.append(state)
            self._step_saves, self._step_blocks = [], {}
        for state in completed:
            for destination in state.destinations:
                self._send(self._control(destination, "complete"))
        self._activate_waiting_orders()

    def _activate_waiting_orders(self) -> None:
        """Give waiting orders of known requests their request (forward thread, between layers' sends): the
        blocks written so far go now, later layers' pages follow from save_kv_layer (or "complete" now)."""
        with self._lock:
            ready = [(request_id, self._waiting_orders.pop(request_id)) for request_id in list(self._waiting_orders)
                     if request_id in self._pushed]
        for request_id, destinations in ready:
            state = self._pushed[request_id]
            for destination in destinations:
                for message in self._catch_up_messages(state.block_ids, state.num_written_tokens, destination):
                    self._send(message)
                if state.is_prefilled:
                    self._send(self._control(destination, "complete"))
                else:
                    state.destinations.append(destination)

    def _catch_up_messages(self, block_ids: list[int], num_written_tokens: int,
                           destination: _Destination) -> list[list[Any]]:
        """Every ordered layer's pages of the blocks holding the first `num_written_tokens` tokens."""
        end = -(-num_written_tokens // self.engine_signature["block_size"])
        messages = [self._layer_message(block_ids, destination, layer_index, 0, end)
                    for layer_index in sorted(destination.layers)]
        sent = [message for message in messages if message is not None]
        self.num_catch_up_sends += len(sent)
        return sent

    def _layer_message(self, block_ids: list[int], destination: _Destination, layer_index: int, first: int,
                       end: int) -> list[Any] | None:
        """[identity, header, one frame per page region] of layer `layer_index`'s blocks at positions [first, end)
        that the destination holds (None: none)."""
        assert self.regions is not None
        low = max(first, destination.first_block)
        high = min(end, destination.first_block + len(destination.block_ids), len(block_ids))
        if high <= low:
            return None
        tensors = self.regions.gather(block_ids[low:high], [layer_index])
        header = {"kind": "layer", "tag": destination.tag, "layer": layer_index, "first_block": low,
                  "count": high - low}
        return [destination.identity, self._encoder.encode(header), *(tensor.numpy() for tensor in tensors)]

    def _control(self, destination: _Destination, kind: str, **extra: Any) -> list[Any]:
        return [destination.identity, self._encoder.encode({"kind": kind, "tag": destination.tag} | extra)]

    def _send(self, message: list[Any]) -> None:
        assert self._outbox is not None
        self._outbox.send_multipart(message, copy=False)

    def get_finished(self, finished_request_ids: set[str]) -> KVConnectorOutput:
        if not self.config.is_producer:
            return super().get_finished(finished_request_ids)
        now = time.monotonic()
        timeout_s = float(self.config.extra("free_timeout_s"))
        with self._lock:
            # A done notice can beat the step that holds the request's blocks (D got "complete" from the forward
            # of P's last step): keep it until the blocks are held, else the scheduler would drop it and free them
            # only after free_timeout_s.
            early = {request_id for request_id in self._done_ids
                     if request_id in self._pushed and request_id not in self._send_deadlines}
            self._done_ids -= early
            expired = {request_id: orders for request_id, orders in self._waiting_orders.items()
                       if request_id not in self._pushed and all(now - order.arrived > timeout_s for order in orders)}
            for request_id in expired:
                del self._waiting_orders[request_id]
        for request_id, orders in expired.items():
            for destination in orders:
                self._send(self._control(destination, "failed", error=f"no request {request_id!r} ran on the "
                                         f"producer within free_timeout_s={timeout_s:g}"))
        output = super().get_finished(finished_request_ids)
        with self._lock:
            self._done_ids |= early
            for request_id in output.finished_sending:
                self._pushed.pop(request_id, None)
                self._waiting_orders.pop(request_id, None)
        return output

    # ---- consumer ----------------------------------------------------------------------------------------------
    def _receive(self) -> None:
        """The consumer's receiver thread: sends push orders, writes the layers that come, ends loads."""
        client = BlockClient(self.context, float(self.config.extra("transfer_timeout_s")))
        verified: dict[tuple[str, int], dict[str, Any]] = {}
        streams: dict[tuple[str, int], zmq.Socket] = {}
        endpoints: dict[zmq.Socket, tuple[str, int]] = {}
        poller = zmq.Poller()
        loads: dict[str, _PushLoad] = {}
        try:
            while True:
                while True:
                    try:
                        order = self._orders.get_nowait()
                    except queue.Empty:
                        break
                    if order is None:
                        return
                    self._start_load(order, client, verified, streams, endpoints, poller, loads)
                for socket, _ in poller.poll(_RECEIVE_POLL_MS if loads else 50):
                    while True:
                        try:
                            frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_message(endpoints[socket], frames, loads, client)
                now = time.monotonic()
                with self._lock:
                    cancelled = [tag for tag in loads if tag in self._cancelled_ids]
                for tag in cancelled:
                    self._end_load(loads.pop(tag), False, True, client)
                for tag in [tag for tag, load in loads.items() if load.deadline <= now]:
                    load = loads.pop(tag)
                    logger.error("request %s: the producer at %s:%d sent no KV for %g s (transfer_timeout_s); the "
                                 "load failed (kv_load_failure_policy=%s)", tag, load.order.remote_host,
                                 load.order.remote_port, float(self.config.extra("transfer_timeout_s")),
                                 self.config.kv_load_failure_policy)
                    self._end_load(load, False, False, client)
        finally:
            for load in loads.values():  # shutdown: nothing more is written into their blocks
                self._end_load(load, False, False, client)
            for socket in streams.values():
                socket.close()
            client.close()

    def _start_load(self, order: LoadOrder, client: BlockClient, verified: dict[tuple[str, int], dict[str, Any]],
                    streams: dict[tuple[str, int], zmq.Socket], endpoints: dict[zmq.Socket, tuple[str, int]],
                    poller: zmq.Poller, loads: dict[str, _PushLoad]) -> None:
        """Handshake with the producer ranks and send them the push order (a failure ends the load at once)."""
        if not order.remote_ports:
            order.remote_ports = [order.remote_port]
        placeholder = _PushLoad(order, KVPullPlan([], [], 1), [], {}, set(), 0.0, time.perf_counter())
        try:
            answers = [self._handshake(client, order.remote_host, port, verified) for port in order.remote_ports]
            for port, answer in zip(order.remote_ports, answers):
                if answer.get("mode") != "push":
                    raise KVTransferError(f"the producer at {order.remote_host}:{port} runs kv_connector_extra_config."
                                          f"mode={answer.get('mode', 'pull')!r}; this consumer's mode='push' needs "
                                          f"the producer in mode 'push' too (or both in 'pull')")
            plan = self._plan(order, answers)
        except KVTransferError as error:
            logger.error("request %s: KV push from %s:%d failed (kv_load_failure_policy=%s): %s", order.request_id,
                         order.remote_host, order.remote_port, self.config.kv_load_failure_policy, error)
            self._end_load(placeholder, False, not isinstance(error, KVTransferTimeout), client)
            return
        sources: dict[tuple[int, int], list[LayerSource]] = {}
        for source in plan.sources:
            sources.setdefault((source.remote_rank, source.remote_layer), []).append(source)
        load = _PushLoad(order, plan, answers, sources, set(plan.remote_layers),
                         time.monotonic() + float(self.config.extra("transfer_timeout_s")), time.perf_counter())
        loads[order.request_id] = load
        for rank, remote_layers in plan.remote_layers.items():
            endpoint = (order.remote_host, order.remote_ports[rank])
            socket = streams.get(endpoint)
            if socket is None:
                socket = self.context.socket(zmq.DEALER)
                socket.setsockopt(zmq.LINGER, 0)
                socket.setsockopt(zmq.RCVHWM, 0)  # a layer stream: never drop at the high-water mark
                socket.connect(f"tcp://{endpoint[0]}:{endpoint[1]}")
                streams[endpoint] = socket
                endpoints[socket] = endpoint
                poller.register(socket, zmq.POLLIN)
            self._push_sequence += 1
            load.sequence = self._push_sequence
            self._sequence_tags[self._push_sequence] = order.request_id
            socket.send(self._encoder.encode({
                "kind": "push_order", "seq": self._push_sequence, "request_id": order.remote_request_id, "tag": order.request_id,
                "block_ids": order.local_block_ids, "first_block": order.first_block, "layers": remote_layers}))

    def _on_message(self, endpoint: tuple[str, int], frames: list[zmq.Frame], loads: dict[str, _PushLoad],
                    client: BlockClient) -> None:
        """One message of a producer's stream: a layer's pages, "complete", "failed", or a refused order."""
        header = msgspec.msgpack.decode(frames[0].buffer)
        if not isinstance(header, dict):
            return
        if header.get("ok") is False:  # the producer refused a push order: its answer carries the order's number
            tag = self._sequence_tags.get(header.get("seq"))  # type: ignore[arg-type]
            load = loads.pop(tag, None) if tag is not None else None
            logger.error("request %s: the producer at %s:%d refused the push order (kv_load_failure_policy=%s): %s",
                         tag, *endpoint, self.config.kv_load_failure_policy, header.get("error"))
            if load is not None:
                self._end_load(load, False, True, client)
            return
        load = loads.get(str(header.get("tag")))
        if load is None:
            return  # a load that ended (cancelled, timed out): nothing more is written into its blocks
        order = load.order
        rank = next((index for index, port in enumerate(order.remote_ports)
                     if (order.remote_host, port) == endpoint), 0)
        kind = header.get("kind")
        try:
            if kind == "layer":
                load.num_bytes += self._write_layer(load, rank, header, frames[1:])
                load.deadline = time.monotonic() + float(self.config.extra("transfer_timeout_s"))
            elif kind == "complete":
                wanted = set(range(order.first_block, order.first_block + len(order.local_block_ids)))
                missing = [layer for layer in load.plan.remote_layers.get(rank, [])
                           if not wanted <= load.received.get((rank, layer), set())]
                if missing:
                    raise KVTransferError(f"the producer said complete but layers {missing} lack some of the "
                                          f"blocks at positions [{order.first_block}, +{len(order.local_block_ids)})")
                load.pending_ranks.discard(rank)
                if not load.pending_ranks:
                    self._end_load(loads.pop(order.request_id), True, True, client)
            elif kind == "failed":
                raise KVTransferError(f"the producer gave up: {header.get('error')}")
        except KVTransferError as error:
            logger.error("request %s: KV push from %s:%d failed (kv_load_failure_policy=%s): %s", order.request_id,
                         *endpoint, self.config.kv_load_failure_policy, error)
            loads.pop(order.request_id, None)
            self._end_load(load, False, True, client)

    def _write_layer(self, load: _PushLoad, rank: int, header: dict[str, Any], frames: list[zmq.Frame]) -> int:
        """Scatter one layer message's pages into the load's blocks; returns the bytes written."""
        order = load.order
        layer, first_block, count = header.get("layer"), header.get("first_block"), header.get("count")
        sources = load.sources.get((rank, layer))  # type: ignore[arg-type]
        if sources is None:
            raise KVTransferError(f"the producer sent layer {layer!r}, which this engine did not order")
        if not isinstance(first_block, int) or not isinstance(count, int) or count < 1 \
                or first_block < order.first_block \
                or first_block + count > order.first_block + len(order.local_block_ids):
            raise KVTransferError(f"the producer sent blocks at positions [{first_block}, +{count}), outside the "
                                  f"ordered [{order.first_block}, +{len(order.local_block_ids)})")
        remote_signature = load.answers[rank]["signature"]
        region_bytes = remote_signature["layers"][layer][1]
        tensors = frames_to_tensors(frames, count, region_bytes)
        offset = first_block - order.first_block
        block_ids = order.local_block_ids[offset:offset + count]
        for source in sources:
            self._write_source(source, block_ids, tensors, remote_signature)
        load.received.setdefault((rank, layer), set()).update(range(first_block, first_block + count))  # type: ignore[arg-type]
        return sum(tensor.numel() for tensor in tensors)

    def _end_load(self, load: _PushLoad, is_loaded: bool, is_reachable: bool, client: BlockClient) -> None:
        """Report the load ended (its blocks in invalid_block_ids unless every layer came) and tell the producer
        it is done with the request, when it can be reached."""
        order = load.order
        self._sequence_tags.pop(load.sequence, None)
        if is_reachable:
            self._notify_done(client, order, load.plan if load.plan.done_ranks else None)
        if is_loaded:
            with self._lock:
                self.num_loaded_bytes += load.num_bytes
                # From the push order to the last layer: it includes P's prefill (the transfer overlaps it).
                self.load_seconds += time.perf_counter() - load.started
        self._report_load_ended(order, is_loaded)

    def shutdown(self) -> None:
        if self._outbox is not None:  # before the context ends (pages still queued are dropped: shutting down)
            self._outbox.close()
            self._outbox = None
        super().shutdown()


__all__ = ["PushConnectorWorker"]
