"""OffloadTier: one memory-mapped file under the chosen directory, one view per layer, removed by close or when
the tier is garbage-collected."""
from __future__ import annotations

import gc
import os

import torch

from pagedserve.sparse_kv_offload.offload_tier import TIER_FILE_PREFIX, OffloadTier


def _tier_files(directory: str) -> list[str]:
    return [name for name in os.listdir(directory) if name.startswith(TIER_FILE_PREFIX)]


def test_layers_share_one_file_that_close_removes(tmp_path) -> None:
    tier = OffloadTier([(3, 4, 6), (3, 4, 5)], torch.float32, str(tmp_path))
    assert _tier_files(str(tmp_path)) == [os.path.basename(tier.path)]
    assert os.path.getsize(tier.path) == (3 * 4 * 6 + 3 * 4 * 5) * 4 == tier.num_bytes
    first, second = tier.layer_views
    assert first.shape == (3, 4, 6) and second.shape == (3, 4, 5) and not first.any()
    first[2, 3] = 7.0
    second[0, 0] = 9.0
    with open(tier.path, "rb") as file:  # written through to the file, each layer in its own region
        values = torch.frombuffer(bytearray(file.read()), dtype=torch.float32)
    assert values[(2 * 4 + 3) * 6:(2 * 4 + 3) * 6 + 6].eq(7.0).all() and values[3 * 4 * 6] == 9.0
    tier.close()
    assert _tier_files(str(tmp_path)) == [] and not tier.is_open
    tier.close()  # idempotent


def test_an_unclosed_tier_removes_its_file_when_collected(tmp_path) -> None:
    tier = OffloadTier([(2, 4, 3)], torch.float32, str(tmp_path))
    assert len(_tier_files(str(tmp_path))) == 1
    del tier
    gc.collect()
    assert _tier_files(str(tmp_path)) == []
