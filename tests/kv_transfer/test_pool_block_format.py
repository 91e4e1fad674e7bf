"""The KV pool's block format: a stored block round-trips; a truncated, corrupted or foreign value is refused
naming why; engines whose blocks differ (dtype, block size, model) never share a key."""
from __future__ import annotations

import pytest

from pagedserve.kv_transfer.pool_block_format import (HEADER, PoolBlockError, block_key, decode_block, encode_block,
                                                      layout_fingerprint)

SIGNATURE = {"block_size": 16, "dtype": "torch.float32", "kv_cache_dtype": "auto", "model": "LlamaForCausalLM",
             "model_name": "tiny"}


def test_round_trip_and_refusals() -> None:
    payload = bytes(range(256)) * 4
    value = encode_block(0xABC, payload)
    assert len(value) == HEADER.size + len(payload)
    assert bytes(decode_block(value, 0xABC, len(payload))) == payload
    flipped = bytearray(value)
    flipped[HEADER.size + 7] ^= 1
    for bad, block_hash, size, reason in (
            (value[:-1], 0xABC, len(payload), "payload of 1023 bytes"),
            (value[:10], 0xABC, len(payload), "shorter than the 32-byte header"),
            (bytes(flipped), 0xABC, len(payload), "checksum mismatch"),
            (value, 0xABD, len(payload), "holds block 0000000000000abc, not 0000000000000abd"),
            (value, 0xABC, 512, "this engine's blocks have 512"),
            (b"XXXX" + value[4:], 0xABC, len(payload), "not a pagedserve block")):
        with pytest.raises(PoolBlockError, match=reason):
            decode_block(bad, block_hash, size)


@pytest.mark.parametrize("change", [{"dtype": "torch.bfloat16"}, {"block_size": 32}, {"kv_cache_dtype": "int8"},
                                    {"model_name": "other"}])
def test_engines_with_different_blocks_never_share_a_key(change: dict) -> None:
    mine = block_key(layout_fingerprint(SIGNATURE), 7)
    assert mine != block_key(layout_fingerprint(SIGNATURE | change), 7)
    assert mine == block_key(layout_fingerprint(dict(reversed(SIGNATURE.items()))), 7)

