"""OffloadTier: one memory-mapped file under the chosen directory, unlinked as soon as it is mapped (so no exit,
SIGKILL included, leaves it behind), one view per layer; a RAM file system is warned about; the start-up checks
against available memory and free disk space."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import pytest
import torch
from process_mappings import mapped_file_paths

from pagedserve.config.sparse_kv_offload import SparseKVOffloadConfig
from pagedserve.sparse_kv_offload.offload_manager import check_offload_fits
from pagedserve.sparse_kv_offload.offload_tier import TIER_FILE_PREFIX, OffloadTier, file_system_type, free_disk_bytes


def _tier_files(directory: str) -> list[str]:
    return [name for name in os.listdir(directory) if name.startswith(TIER_FILE_PREFIX)]


def _mapped_tier_files(directory: str) -> list[str]:
    return mapped_file_paths(os.path.join(directory, TIER_FILE_PREFIX))


def test_layers_share_one_mapped_file_without_a_name(tmp_path) -> None:
    tier = OffloadTier([(3, 4, 6), (3, 4, 5)], torch.float32, str(tmp_path))
    assert _tier_files(str(tmp_path)) == [] and tier.is_open
    assert _mapped_tier_files(str(tmp_path)) == [f"{tier.path} (deleted)"]
    assert tier.num_bytes == (3 * 4 * 6 + 3 * 4 * 5) * 4
    first, second = tier.layer_views
    assert first.shape == (3, 4, 6) and second.shape == (3, 4, 5) and not first.any()
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()  # one mapping
    first[2, 3] = 7.0
    second[0, 0] = 9.0
    assert first[2, 3].eq(7.0).all() and second[0, 0].eq(9.0).all() and first.sum() == 7.0 * 6
    tier.close()
    assert not tier.is_open and tier.layer_views == []
    tier.close()  # idempotent
    del first, second
    import gc
    gc.collect()
    assert _mapped_tier_files(str(tmp_path)) == []  # the last view gone: the mapping (and its space) too


_KILLED_CHILD = """
import os, signal, sys, torch
from pagedserve.sparse_kv_offload.offload_tier import OffloadTier
tier = OffloadTier([(64, 16, 32)], torch.float32, sys.argv[1])
tier.layer_views[0].fill_(1.0)
print(tier.path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_process_leaves_no_tier_file(tmp_path) -> None:
    child = subprocess.run([sys.executable, "-c", _KILLED_CHILD, str(tmp_path)], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert child.stdout.strip().startswith(str(tmp_path))
    assert _tier_files(str(tmp_path)) == []


def test_a_ram_file_system_is_warned_about(tmp_path, caplog) -> None:
    if not os.path.isdir("/dev/shm") or file_system_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm on this machine")
    with caplog.at_level(logging.WARNING, logger="pagedserve.sparse_kv_offload.offload_tier"):
        tier = OffloadTier([(2, 4, 3)], torch.float32, "/dev/shm")
    assert "is on tmpfs, which keeps files in RAM" in caplog.text and "/dev/shm" in caplog.text
    tier.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedserve.sparse_kv_offload.offload_tier"):
        OffloadTier([(2, 4, 3)], torch.float32, str(tmp_path)).close()
    assert ("keeps files in RAM" in caplog.text) == (file_system_type(str(tmp_path)) in ("tmpfs", "ramfs"))


def test_file_system_type_finds_the_longest_mount_point() -> None:
    assert file_system_type("/") not in (None, "")
    if os.path.isdir("/proc/self"):
        assert file_system_type("/proc/self") == "proc"


def test_plans_beyond_memory_or_disk_are_refused_naming_the_knobs(tmp_path) -> None:
    config = SparseKVOffloadConfig(8, tier_directory=str(tmp_path))
    check_offload_fits(config, tier_bytes=2**20, resident_bytes=2**20, available_bytes=2**30, max_num_seqs=4)
    with pytest.raises(ValueError, match=r"num_resident_blocks=8 per request and layer, max_num_seqs=4\) need "
                                         r"1024.0 MiB, more than the 512.0 MiB available"):
        check_offload_fits(config, tier_bytes=2**20, resident_bytes=2**30, available_bytes=2**29, max_num_seqs=4)
    too_big = free_disk_bytes(str(tmp_path)) + 2**30
    with pytest.raises(ValueError, match=rf"the tier needs .* MiB but tier_directory='{tmp_path}' has .* MiB free"):
        check_offload_fits(config, tier_bytes=too_big, resident_bytes=0, available_bytes=2**30, max_num_seqs=4)
