"""Without a Ray session, the 'ray' executor starts a local Ray cluster sized to this machine, shares it
between the executors of one process, and ends it when the last one shuts down: no actor, raylet or GCS
process of ours is left. (test_ray_executor.py covers a session the user started; this file runs on its
own so that no other Ray session is up.)"""
from __future__ import annotations

import os

import psutil
import pytest
import ray
from ray.util import placement_group_table

from pagedserve import LLM, SamplingParams
from worker_death_checks import pids_still_running


def test_engines_start_share_and_end_their_own_local_cluster(tiny_model_dir) -> None:
    if ray.is_initialized():
        pytest.fail("a Ray session is already up: this test needs to start its own")
    folder = tiny_model_dir("llama")
    # Processes earlier tests left to this interpreter on purpose (e.g. Inductor's compile-worker pool)
    # are not Ray's: only processes started from here on are checked.
    earlier_pids = {child.pid for child in psutil.Process().children(recursive=True)}
    # Two DP ranks: two engine cores, each with its own Ray executor (one actor each), one session.
    llm = LLM(folder, data_parallel_size=2, distributed_executor_backend="ray", max_model_len=128,
              num_kv_blocks=32)
    cores = llm.llm_engine.engine_core.cores
    try:
        assert ray.is_initialized()
        assert ray.cluster_resources()["CPU"] == os.cpu_count()
        executors = [core.executor for core in cores]
        groups = [executor.placement_group for executor in executors]
        pids = [pid for executor in executors for pid in executor.worker_pids]
        descendants = [child for child in psutil.Process().children(recursive=True)
                       if child.pid not in earlier_pids]
        names = {child.name() for child in descendants}
        assert {"gcs_server", "raylet"} <= names, names  # the local cluster runs under this process
        # The actors' processes are raylet-owned workers, so they are among the descendants too.
        assert set(pids) <= {child.pid for child in descendants}
        outputs = llm.generate([{"prompt_token_ids": [5, 9, 14, 200]}, {"prompt_token_ids": [7, 8]}],
                               SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert [len(output.outputs[0].token_ids) for output in outputs] == [4, 4]
        assert all(placement_group_table(group)["state"] == "CREATED" for group in groups)
        # The first executor's shutdown leaves the session to the second.
        cores[0].shutdown()
        assert ray.is_initialized()
        assert placement_group_table(groups[0])["state"] == "REMOVED"
        assert placement_group_table(groups[1])["state"] == "CREATED"
    finally:
        llm.llm_engine.shutdown()
    assert not ray.is_initialized()
    assert pids_still_running(pids) == []
    # Nothing Ray started is left: GCS, raylet, idle and actor workers, log monitor...
    assert pids_still_running([child.pid for child in descendants]) == []
