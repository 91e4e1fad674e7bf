"""The zmq transport of the pull connector: a producer's block server and a consumer's client.

One ROUTER socket on the producer answers three requests, each a msgpack header frame (never pickle):
- {"kind": "handshake"} -> {"ok": true, "signature": {...}} (kv_page_regions.py: what both sides compare), with
  the mooncake transport's descriptor under "mooncake" when the producer uses it;
- {"kind": "read", "block_ids": [...], "layers": [...]} -> {"ok": true} followed by one raw frame per page region
  of the layers (indices into the handshake's layers; absent: every layer), the blocks' bytes in order, sent
  zero-copy from the gathered tensors;
- {"kind": "done", "request_id": ..., "num_readers": n} -> {"ok": true}: one of the n consumer ranks that read
  this producer rank (default 1) no longer needs the request's blocks.
Every request carries a sequence number echoed in its answer, so a late answer to a timed-out request is dropped.
A failure is {"ok": false, "error": "..."}. The consumer drops a socket whose answer timed out (lazy pirate).
A connector may add request kinds (`handlers`: kind -> the messages to send to the asker, the push mode's
"push_order") and an outbox: an inproc address whose messages ([consumer identity, frames...]) the server thread
forwards to that consumer, so other threads (the forward's save_kv_layer) send through the one ROUTER socket.
"""
from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from typing import Any

import msgspec
import torch
import zmq

from pagedserve.kv_transfer.kv_page_regions import KVPageRegions

logger = logging.getLogger(__name__)

_POLL_INTERVAL_MS = 100


class KVTransferError(RuntimeError):
    """A block transfer failed: the peer answered with an error, did not answer in time, or does not match."""


class KVTransferTimeout(KVTransferError):
    """The peer did not answer within transfer_timeout_s (it may be gone)."""


class BlockServer:
    """The producer's server thread: handshakes, block reads, done notices (see the module docstring)."""

    def __init__(self, context: zmq.Context, host: str, port: int, regions: KVPageRegions,
                 on_done: Callable[[str, int], None], handshake_extra: dict[str, Any] | None = None,
                 handlers: dict[str, Callable[[bytes, dict[str, Any]], list[list[Any]]]] | None = None,
                 outbox_address: str | None = None) -> None:
        """`handshake_extra`: more keys for the handshake answer (the mooncake transport's descriptor);
        `handlers`: more request kinds, each answered by the messages (frame lists) its handler returns for the
        asker's identity; `outbox_address`: an inproc address to forward [identity, frames...] messages from."""
        self.regions = regions
        self.on_done = on_done
        self.handshake_extra = handshake_extra or {}
        self.handlers = handlers or {}
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.outbox: zmq.Socket | None = None
        if outbox_address is not None:
            # A layer stream is many messages to one consumer: never drop one at the high-water mark.
            self.socket.setsockopt(zmq.SNDHWM, 0)
            self.outbox = context.socket(zmq.PULL)
            self.outbox.setsockopt(zmq.LINGER, 0)
            self.outbox.bind(outbox_address)
        address = f"tcp://{host}"
        try:
            if port == 0:
                self.port = self.socket.bind_to_random_port(address)
            else:
                self.socket.bind(f"{address}:{port}")
                self.port = port
        except zmq.ZMQError as error:
            self.socket.close()
            if self.outbox is not None:
                self.outbox.close()
            # `port` is this rank's: kv_port + its DP and worker rank offset (config/kv_transfer.py).
            raise ValueError(f"kv_transfer_config.kv_port: this rank's block server cannot listen on {host}:{port} "
                             f"(kv_port plus the rank's offset; {error})") from None
        self._encoder = msgspec.msgpack.Encoder()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pagedserve-kv-block-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        if self.outbox is not None:
            poller.register(self.outbox, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(_POLL_INTERVAL_MS))
            if self.outbox is not None and self.outbox in events:
                # Queued sends first: a request handled below may answer after what was queued before it.
                while True:
                    try:
                        message = self.outbox.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self.socket.send_multipart(message, copy=False)
            if self.socket not in events:
                continue
            identity, *frames = self.socket.recv_multipart()
            replies: list[list[Any]]
            try:
                header = msgspec.msgpack.decode(frames[0]) if frames else None
                if not isinstance(header, dict):
                    raise KVTransferError(f"a request must be one msgpack map, got {len(frames)} frames")
                handler = self.handlers.get(header.get("kind"))  # type: ignore[arg-type]
                replies = handler(identity, header) if handler is not None else [self._answer(header)]
            except Exception as error:  # one bad request never stops the server
                logger.warning("KV block server: %s", error)
                sequence = header.get("seq") if isinstance(header, dict) else None
                replies = [[self._encoder.encode({"ok": False, "seq": sequence, "error": str(error)})]]
            for reply in replies:
                self.socket.send_multipart([identity, *reply], copy=False)
        self.socket.close()
        if self.outbox is not None:
            self.outbox.close()

    def _answer(self, header: dict[str, Any]) -> list[Any]:
        kind, sequence = header.get("kind"), header.get("seq")
        if kind == "handshake":
            return [self._encoder.encode({"ok": True, "seq": sequence, "signature": self.regions.signature}
                                         | self.handshake_extra)]
        if kind == "done":
            num_readers = header.get("num_readers", 1)
            if not isinstance(num_readers, int) or num_readers < 1:
                raise KVTransferError(f"done: num_readers={num_readers!r} must be an integer >= 1")
            self.on_done(str(header.get("request_id")), num_readers)
            return [self._encoder.encode({"ok": True, "seq": sequence})]
        if kind == "read":
            block_ids = header.get("block_ids")
            num_blocks = self.regions.num_blocks
            if not isinstance(block_ids, list) or not all(
                    isinstance(block_id, int) and 0 < block_id < num_blocks for block_id in block_ids):
                raise KVTransferError(f"read: block_ids={block_ids!r} must be block ids in [1, {num_blocks - 1}]")
            layers = header.get("layers")
            num_layers = len(self.regions.regions)
            if layers is not None and (not isinstance(layers, list) or not all(
                    isinstance(index, int) and 0 <= index < num_layers for index in layers)):
                raise KVTransferError(f"read: layers={layers!r} must be layer indices in [0, {num_layers - 1}]")
            # numpy views of the gathered copies: zmq sends them without another copy.
            tensors = self.regions.gather(block_ids, layers)
            return [self._encoder.encode({"ok": True, "seq": sequence}), *(tensor.numpy() for tensor in tensors)]
        raise KVTransferError(f"unknown request kind={kind!r}; known: "
                              f"{', '.join(['handshake', 'read', 'done', *self.handlers])}")

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class BlockClient:
    """The consumer's side: one DEALER socket per producer, a sequence number per request."""

    def __init__(self, context: zmq.Context, timeout_s: float) -> None:
        self.context = context
        self.timeout_ms = int(timeout_s * 1000)
        self._sockets: dict[tuple[str, int], zmq.Socket] = {}
        self._sequence = 0
        self._encoder = msgspec.msgpack.Encoder()

    def _socket(self, host: str, port: int) -> zmq.Socket:
        socket = self._sockets.get((host, port))
        if socket is None:
            socket = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(f"tcp://{host}:{port}")
            self._sockets[(host, port)] = socket
        return socket

    def call(self, host: str, port: int, header: dict[str, Any]) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """Send one request and wait for its answer: (the answer's header, its raw frames). KVTransferError when
        the producer answers with an error or not within the timeout."""
        self._sequence += 1
        sequence = self._sequence
        socket = self._socket(host, port)
        socket.send(self._encoder.encode(header | {"seq": sequence}))
        deadline_ms = self.timeout_ms
        while True:
            if not socket.poll(deadline_ms, zmq.POLLIN):
                socket.close()
                del self._sockets[(host, port)]
                raise KVTransferTimeout(f"the producer at {host}:{port} did not answer {header.get('kind')!r} within "
                                      f"{self.timeout_ms / 1000:g} s (transfer_timeout_s)")
            frames = socket.recv_multipart(copy=False)
            answer = msgspec.msgpack.decode(frames[0].buffer)
            if not isinstance(answer, dict) or answer.get("seq") != sequence:
                continue  # a late answer to a request that timed out earlier
            if not answer.get("ok"):
                raise KVTransferError(f"the producer at {host}:{port} refused {header.get('kind')!r}: "
                                      f"{answer.get('error')}")
            return answer, frames[1:]

    def close(self) -> None:
        for socket in self._sockets.values():
            socket.close()
        self._sockets.clear()


def frames_to_tensors(frames: list[zmq.Frame], num_blocks: int, region_bytes: list[int]) -> list[torch.Tensor]:
    """Received region frames as [num_blocks, region bytes] uint8 tensors over the frames' memory (no copy);
    KVTransferError when their number or sizes differ from the local regions'."""
    if len(frames) != len(region_bytes):
        raise KVTransferError(f"the producer sent {len(frames)} page regions, this engine has {len(region_bytes)}")
    tensors = []
    for index, (frame, nbytes) in enumerate(zip(frames, region_bytes)):
        buffer = frame.buffer
        if len(buffer) != num_blocks * nbytes:
            raise KVTransferError(f"page region {index}: the producer sent {len(buffer)} bytes for {num_blocks} "
                                  f"blocks, this engine expects {num_blocks * nbytes}")
        with warnings.catch_warnings():  # zmq's frames are read-only; they are only read from
            warnings.simplefilter("ignore", UserWarning)
            tensors.append(torch.frombuffer(buffer, dtype=torch.uint8).view(num_blocks, nbytes))
    return tensors
