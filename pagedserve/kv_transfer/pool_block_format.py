"""How a full KV block is named and laid out in a KV pool store.

Key: `pagedserve-kv/<layout fingerprint>/<chained block hash, 16 hex digits>`. The fingerprint digests the model
(its name as given and its shape), the block size and the weight and KV dtypes, so engines whose blocks differ never
share a key; equal chained hashes mean equal token prefixes (core/block_hash.py).

Value: a 32-byte header, then the block's bytes for every layer (KVPageRegions.gather order, one block):
    magic b"PSKV", format version (u32), block hash (u64), payload length (u64), crc32 of the payload (u32),
    reserved (u32), all little-endian.
A value whose magic, version, hash, length or checksum does not match is rejected (the block is recomputed).
"""
from __future__ import annotations

import hashlib
import json
import struct
import zlib
from typing import Any

KEY_PREFIX = "pagedserve-kv"
MAGIC = b"PSKV"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sIQQII")


class PoolBlockError(ValueError):
    """A value read from the pool is not the block it should be (truncated, corrupted, another block)."""


def layout_fingerprint(engine_signature: dict[str, Any]) -> str:
    """16 hex digits that differ between engines whose KV blocks differ: `engine_signature` is
    connector_factory.kv_engine_signature (model name and shape, block size, dtypes)."""
    text = json.dumps(engine_signature, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def block_key(fingerprint: str, block_hash: int) -> str:
    return f"{KEY_PREFIX}/{fingerprint}/{block_hash:016x}"


def encode_block(block_hash: int, payload: bytes | memoryview) -> bytes:
    """The stored value of one block: the header, then `payload` (the block's bytes, every layer)."""
    view = memoryview(payload).cast("B")
    header = HEADER.pack(MAGIC, FORMAT_VERSION, block_hash, view.nbytes, zlib.crc32(view), 0)
    return header + bytes(view)


def decode_block(value: bytes | memoryview, block_hash: int, payload_bytes: int) -> memoryview:
    """The payload of a stored value, checked against the block it must be; PoolBlockError says why not."""
    view = memoryview(value).cast("B")
    if view.nbytes < HEADER.size:
        raise PoolBlockError(f"value of {view.nbytes} bytes is shorter than the {HEADER.size}-byte header")
    magic, version, stored_hash, length, checksum, _ = HEADER.unpack_from(view)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise PoolBlockError(f"not a pagedserve block (magic {magic!r}, version {version})")
    if stored_hash != block_hash:
        raise PoolBlockError(f"value holds block {stored_hash:016x}, not {block_hash:016x}")
    if length != payload_bytes or view.nbytes - HEADER.size != payload_bytes:
        raise PoolBlockError(f"payload of {view.nbytes - HEADER.size} bytes (header says {length}); this engine's "
                             f"blocks have {payload_bytes}")
    payload = view[HEADER.size:]
    if zlib.crc32(payload) != checksum:
        raise PoolBlockError("payload checksum mismatch (corrupted in the store or on the way)")
    return payload
