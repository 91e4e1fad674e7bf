"""The 'ray' executor over two Ray nodes: a cluster started the way a user starts one (`ray start --head`,
then `ray start --address` as a second node; here both on this host), an engine process pointed at it
through RAY_ADDRESS (ray_cluster_driver.py), TP=2 with one rank on each node: token for token what one
process generates. (docs/params-05-parallel.md, "Running on a multi-node Ray cluster".)

Each node has one CPU, so the placement group's two {CPU: 1} bundles cannot share a node. The nodes run as
`ray start --block` children of this test, in a temp dir of their own; the teardown stops them with SIGTERM
(a `--block` process then stops its node's processes) and checks that no process of theirs is left. Not
`ray stop`: it stops every Ray process on the machine, other sessions' too. The cluster and its driver run
without Ray's token authentication (RAY_AUTH_MODE=disabled in their environment): a head turns it on when
a token file exists (~/.ray/auth_token, which any local cluster leaves), and the driver and the second node
would then need the token too. This test process never joins Ray itself.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import psutil
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.distributed.worker_init import free_loopback_port
from generation_helpers import generated_token_ids, random_prompts
from ray_cluster_driver import RESULT_PREFIX

ENGINE = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=64)
NODE_START_TIMEOUT_S = 180.0
DRIVER_TIMEOUT_S = 400.0
# A second node drains for up to 30 s after SIGTERM before it stops its processes.
NODE_STOP_TIMEOUT_S = 45.0


def _ray_start(temp_dir: str, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """`ray start --block <args>` as a child process logging to `temp_dir`/`name`.log (in this process group:
    a Ctrl-C of the test run stops it too)."""
    with open(os.path.join(temp_dir, f"{name}.log"), "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", *args,
             "--num-cpus=1", "--object-store-memory=157286400", "--disable-usage-stats", f"--temp-dir={temp_dir}",
             f"--dashboard-agent-listen-port={free_loopback_port()}",
             f"--metrics-export-port={free_loopback_port()}", f"--runtime-env-agent-port={free_loopback_port()}"],
            stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait_until_started(node: subprocess.Popen, temp_dir: str, name: str, deadline: float) -> None:
    log_path = os.path.join(temp_dir, f"{name}.log")
    while True:
        with open(log_path) as log:
            text = log.read()
        if "Ray runtime started" in text:
            return
        if node.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"`ray start` of the {name} node did not start (exit code {node.poll()}):\n{text}")
        time.sleep(0.2)


def _processes_under(temp_dir: str) -> list[psutil.Process]:
    """Processes whose command line names `temp_dir` (every process of these nodes does; nobody else's)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in argument for argument in process.info["cmdline"] or ()):
                found.append(process)
        except psutil.Error:
            pass
    return found


def _stop_nodes(nodes: list[subprocess.Popen], temp_dir: str) -> list[str]:
    """SIGTERM each `ray start --block` (it stops its node's processes), then kill whatever of these nodes is
    still running, by pid. The command lines of what had to be killed (empty when the nodes stopped)."""
    for node in reversed(nodes):  # the second node before the head
        if node.poll() is None:
            node.send_signal(signal.SIGTERM)
            try:
                node.wait(NODE_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait()
    leftovers = [process for process in _processes_under(temp_dir) if process.pid != os.getpid()]
    _, alive = psutil.wait_procs(leftovers, timeout=10)  # a worker process exits shortly after its raylet
    names = []
    for process in alive:
        try:
            names.append(" ".join(process.cmdline())[:200])
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
    return names


@pytest.fixture
def two_node_cluster() -> Iterator[dict[str, str]]:
    """A head node and a second node of one CPU each on this host; the environment a driver process joins
    them with (RAY_ADDRESS)."""
    # Short: Ray's socket paths under the temp dir must fit in a unix socket address (107 bytes).
    temp_dir = tempfile.mkdtemp(prefix="psray-", dir="/tmp")
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    port = free_loopback_port()
    nodes: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        nodes.append(_ray_start(temp_dir, "head", ["--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                                                   "--include-dashboard=false"], env))
        _wait_until_started(nodes[0], temp_dir, "head", deadline)
        nodes.append(_ray_start(temp_dir, "second", [f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1"],
                                env))
        _wait_until_started(nodes[1], temp_dir, "second", deadline)
        yield dict(env, RAY_ADDRESS=f"127.0.0.1:{port}")
    finally:
        killed = _stop_nodes(nodes, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert killed == [], f"processes of the two Ray nodes outlived their `ray start --block`: {killed}"


def test_tp2_with_one_rank_per_ray_node_equals_single_process(two_node_cluster: dict[str, str],
                                                              tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")  # float32 weights: TP=2 gives the single-process run's tokens exactly
    prompts = random_prompts(4, 3, 40, seed=8)
    max_tokens = 24
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    expected = [list(tokens) for tokens in generated_token_ids(LLM(folder, **ENGINE), prompts, params)]  # 'uni'
    driver = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_cluster_driver.py")
    arguments = json.dumps(dict(folder=folder, prompts=prompts, max_tokens=max_tokens, engine_kwargs=ENGINE))
    run = subprocess.run([sys.executable, driver, arguments], env=two_node_cluster, capture_output=True,
                         text=True, timeout=DRIVER_TIMEOUT_S)
    lines = [line for line in run.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert run.returncode == 0 and lines, f"the driver failed ({run.returncode}):\n{run.stdout}\n{run.stderr}"
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    assert result["executor"] == "RayExecutor"
    port = two_node_cluster["RAY_ADDRESS"].rsplit(":", 1)[1]
    assert result["gcs_address"].endswith(f":{port}")  # the executor joined the cluster RAY_ADDRESS names
    assert len(set(result["node_ids"])) == 2, result["node_ids"]  # one rank on each node
    assert result["tokens"] == expected
    assert result["ray_initialized_after_shutdown"] is False  # the engine disconnected from the cluster
