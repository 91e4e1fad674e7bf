"""Chained block hashes: the identity of a full KV block for the prefix cache.

A block's hash covers its own token ids, the hash of the block before it and optional extra keys, so
equal hashes mean equal *prefixes*, not merely equal blocks. Hashes are computed with sha256 over a
fixed byte encoding, never with Python's `hash()`, so they are stable across processes and runs (a
requirement once hashes travel between engine processes or to a host KV pool).
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from pagedserve.core.request import Request

BlockHash = int
ExtraKey = str | int | bytes

# The parent of the first block. A fixed non-zero value distinguishes "no parent" from any real hash
# that happens to be 0.
ROOT_BLOCK_HASH: BlockHash = int.from_bytes(hashlib.sha256(b"pagedserve.block_hash.root").digest()[:8], "little")


def _encode_extra_key(key: ExtraKey) -> bytes:
    # Type tag + length prefix keeps different keys from colliding after concatenation.
    if isinstance(key, bool):
        raise ValueError(f"extra key={key!r} has type bool; allowed types are str, int and bytes")
    if isinstance(key, str):
        data = key.encode("utf-8")
        return b"s" + struct.pack("<Q", len(data)) + data
    if isinstance(key, int):
        return b"i" + key.to_bytes(16, "little", signed=True)
    if isinstance(key, bytes):
        return b"b" + struct.pack("<Q", len(key)) + key
    raise ValueError(f"extra key={key!r} has type {type(key).__name__}; allowed types are str, int and bytes")


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[ExtraKey] | None = None,
) -> BlockHash:
    """Hash one block: H(parent hash, token ids, extra keys) as an unsigned 64-bit int.

    `parent_block_hash` is None for the first block of a sequence.
    """
    parent = ROOT_BLOCK_HASH if parent_block_hash is None else parent_block_hash
    hasher = hashlib.sha256()
    hasher.update(struct.pack("<QQ", parent, len(token_ids)))
    hasher.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    for key in extra_keys or ():
        hasher.update(_encode_extra_key(key))
    return int.from_bytes(hasher.digest()[:8], "little")


def block_extra_keys(request: Request, block_index: int) -> tuple[ExtraKey, ...]:
    """Extra keys mixed into block `block_index` of `request`.

    The cache salt goes into the first block only: the chain carries it into every later hash.
    """
    if block_index == 0 and request.cache_salt is not None:
        return (request.cache_salt,)
    return ()


def update_request_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend `request.block_hashes` to cover every full block of the request's known tokens.

    Only blocks that became full since the last call are hashed (token lists are append-only).
    Returns `request.block_hashes`.
    """
    num_full_blocks = request.num_tokens // block_size
    num_hashed_blocks = len(request.block_hashes)
    if num_full_blocks <= num_hashed_blocks:
        return request.block_hashes
    token_ids = request.all_token_ids
    parent = request.block_hashes[-1] if request.block_hashes else None
    for block_index in range(num_hashed_blocks, num_full_blocks):
        start = block_index * block_size
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], block_extra_keys(request, block_index))
        request.block_hashes.append(parent)
    return request.block_hashes
