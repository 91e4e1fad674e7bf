"""Which data parallel rank of a push-mode producer runs a request: a function of the request's id alone.

In push mode D sends its push order to P's block server before P has the request (the proxy sends both at once), so
D must know the P rank that will run it. A push-mode producer with data_parallel_size > 1 therefore routes each
request to `push_producer_rank(request_id, data_parallel_size)` (engine/dp_engine_core.py) instead of the least
loaded rank, and the push-mode proxy names that rank's engine id and ports in D's kv_transfer_params
(proxy/kv_transfer_mode.py). The first 8 bytes of BLAKE2b over the id's UTF-8 bytes (big-endian), modulo the DP size:
stable across processes and Python versions (unlike hash()), and even over ids that differ in one character (a
CRC's low bits are linear in the input: ids p0..p3 all land on one of two ranks). Pure Python.
"""
from __future__ import annotations

import hashlib


def push_producer_rank(request_id: str, data_parallel_size: int) -> int:
    """The DP rank in [0, data_parallel_size) of a push-mode producer that runs the engine request `request_id`."""
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size={data_parallel_size} must be >= 1")
    digest = hashlib.blake2b(request_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % data_parallel_size


__all__ = ["push_producer_rank"]
