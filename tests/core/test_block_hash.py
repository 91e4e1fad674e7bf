"""Chained block hashes: stable, chained, salted, computed incrementally."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedserve.core.block_hash import (
    ROOT_BLOCK_HASH,
    hash_block_tokens,
    update_request_block_hashes,
)


def test_hash_is_a_deterministic_unsigned_64_bit_int() -> None:
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hash_block_tokens(None, [1, 2, 3, 4])
    assert 0 <= first < 2**64
    assert first != ROOT_BLOCK_HASH


def test_hash_depends_on_parent_tokens_order_and_extra_keys() -> None:
    base = hash_block_tokens(None, [1, 2, 3, 4])
    variants = {
        hash_block_tokens(base, [1, 2, 3, 4]),
        hash_block_tokens(None, [1, 2, 3, 5]),
        hash_block_tokens(None, [4, 3, 2, 1]),
        hash_block_tokens(None, [1, 2, 3]),
        hash_block_tokens(None, [1, 2, 3, 4], ("salt",)),
        hash_block_tokens(None, [1, 2, 3, 4], (7,)),
        hash_block_tokens(None, [1, 2, 3, 4], (b"salt",)),
        hash_block_tokens(0, [1, 2, 3, 4]),
    }
    assert len(variants) == 8
    assert base not in variants


def test_hash_is_stable_across_processes_and_hash_seeds() -> None:
    code = ("from pagedserve.core.block_hash import hash_block_tokens;"
            "print(hash_block_tokens(hash_block_tokens(None, [5, 6, 7], ('s',)), [8, 9]))")
    expected = hash_block_tokens(hash_block_tokens(None, [5, 6, 7], ("s",)), [8, 9])
    # The child resolves imports exactly as this process does.
    import_path = os.pathsep.join(entry for entry in sys.path if entry)
    for seed in ("0", "12345"):
        environment = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": import_path}
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment,
                                check=True)
        assert int(result.stdout.strip()) == expected


def test_bad_extra_key_raises_value_error() -> None:
    with pytest.raises(ValueError, match="extra key"):
        hash_block_tokens(None, [1], (1.5,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="extra key"):
        hash_block_tokens(None, [1], (True,))


def test_request_hashes_cover_full_blocks_only_and_grow_incrementally(make_request) -> None:
    request = make_request("r", list(range(10)))
    hashes = update_request_block_hashes(request, block_size=4)
    first = hash_block_tokens(None, [0, 1, 2, 3])
    second = hash_block_tokens(first, [4, 5, 6, 7])
    assert hashes == [first, second]
    assert request.block_hashes is hashes

    request.append_output_token_ids([10])
    assert update_request_block_hashes(request, 4) == [first, second]  # 11 tokens: still 2 full blocks
    request.append_output_token_ids([11])
    assert update_request_block_hashes(request, 4) == [first, second, hash_block_tokens(second, [8, 9, 10, 11])]


def test_cache_salt_changes_every_block_hash(make_request) -> None:
    plain = make_request("a", list(range(12)))
    salted = make_request("b", list(range(12)), cache_salt="tenant-1")
    other_salt = make_request("c", list(range(12)), cache_salt="tenant-2")
    same_salt = make_request("d", list(range(12)), cache_salt="tenant-1")
    hashes = [update_request_block_hashes(request, 4) for request in (plain, salted, other_salt, same_salt)]
    for block_index in range(3):
        assert len({hashes[kind][block_index] for kind in range(3)}) == 3
    assert hashes[1] == hashes[3]
    assert hashes[1][0] == hash_block_tokens(None, [0, 1, 2, 3], ("tenant-1",))
    # The salt rides in the first block only; the chain carries it on.
    assert hashes[1][1] == hash_block_tokens(hashes[1][0], [4, 5, 6, 7])
