"""CPU binding: topology reading and binding plans on fabricated /sys trees, and a real bind."""
from __future__ import annotations

import os

import pytest
import torch

from pagedserve.platforms.cpu_binding import (CpuTopology, apply_cpu_binding, format_cpu_list, parse_cpu_list,
                                              plan_cpu_binding, read_cpu_topology)


def write_sys_tree(root: str, cores_of_cpu: dict[int, int], nodes: dict[int, str] | None = None,
                   package_of_cpu: dict[int, int] | None = None) -> str:
    """A fake /sys: cpuN/topology/{core_id,physical_package_id} and nodeN/cpulist."""
    cpu_root = os.path.join(root, "devices", "system", "cpu")
    os.makedirs(cpu_root)
    with open(os.path.join(cpu_root, "online"), "w") as f:
        f.write(format_cpu_list(sorted(cores_of_cpu)) + "\n")
    for cpu_id, core_id in cores_of_cpu.items():
        topology = os.path.join(cpu_root, f"cpu{cpu_id}", "topology")
        os.makedirs(topology)
        with open(os.path.join(topology, "core_id"), "w") as f:
            f.write(f"{core_id}\n")
        with open(os.path.join(topology, "physical_package_id"), "w") as f:
            f.write(f"{(package_of_cpu or {}).get(cpu_id, 0)}\n")
    for node_id, cpulist in (nodes or {}).items():
        node_dir = os.path.join(root, "devices", "system", "node", f"node{node_id}")
        os.makedirs(node_dir)
        with open(os.path.join(node_dir, "cpulist"), "w") as f:
            f.write(cpulist + "\n")
    return root


@pytest.fixture
def two_cores(tmp_path) -> str:
    return write_sys_tree(str(tmp_path / "two"), {0: 0, 1: 1}, {0: "0-1"})


@pytest.fixture
def eight_cores_smt(tmp_path) -> str:
    # Linux numbering: cpu i and cpu i + 8 are the two hyperthreads of core i.
    return write_sys_tree(str(tmp_path / "smt"), {cpu: cpu % 8 for cpu in range(16)}, {0: "0-15"})


@pytest.fixture
def two_numa_nodes(tmp_path) -> str:
    # Two sockets of 4 cores; core ids restart per package, so the package tells cores apart.
    return write_sys_tree(str(tmp_path / "numa"), {cpu: cpu % 4 for cpu in range(8)}, {0: "0-3", 1: "4-7"},
                          package_of_cpu={cpu: cpu // 4 for cpu in range(8)})


def test_cpu_list_round_trip() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("") == []
    assert format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert format_cpu_list([]) == ""


def test_two_cores_no_smt(two_cores: str) -> None:
    topology = read_cpu_topology(two_cores, allowed_cpus={0, 1})
    assert topology == CpuTopology(cores=((0,), (1,)), core_nodes=(0, 0))
    one = plan_cpu_binding(topology, 1, reserve_engine_core=False)
    assert (one.worker_cpus, one.worker_num_threads, one.engine_cpus) == (((0, 1),), (2,), ())
    reserved = plan_cpu_binding(topology, 1, reserve_engine_core=True)
    assert (reserved.worker_cpus, reserved.worker_num_threads, reserved.engine_cpus) == (((0,),), (1,), (1,))
    # No core to spare: two ranks take one core each and nothing is reserved.
    two = plan_cpu_binding(topology, 2, reserve_engine_core=True)
    assert (two.worker_cpus, two.worker_num_threads, two.engine_cpus) == (((0,), (1,)), (1, 1), ())
    with pytest.raises(ValueError, match="world_size=3"):
        plan_cpu_binding(topology, 3)


def test_eight_cores_with_smt(eight_cores_smt: str) -> None:
    topology = read_cpu_topology(eight_cores_smt, allowed_cpus=set(range(16)))
    assert topology.cores == tuple((core, core + 8) for core in range(8))
    plan = plan_cpu_binding(topology, 2, reserve_engine_core=True)
    # Core 7 (cpus 7, 15) is reserved; 7 cores left give 3 per rank; core 6 is the remainder.
    assert plan.worker_cpus == ((0, 1, 2, 8, 9, 10), (3, 4, 5, 11, 12, 13))
    assert plan.worker_num_threads == (3, 3)  # one thread per physical core, not per hyperthread
    assert plan.engine_cpus == (6, 7, 14, 15)
    one = plan_cpu_binding(topology, 1, reserve_engine_core=False)
    assert one.worker_cpus == (tuple(range(16)),) and one.worker_num_threads == (8,)


def test_two_numa_nodes(two_numa_nodes: str) -> None:
    topology = read_cpu_topology(two_numa_nodes, allowed_cpus=set(range(8)))
    assert topology.cores == tuple((cpu,) for cpu in range(8))
    assert topology.core_nodes == (0, 0, 0, 0, 1, 1, 1, 1)
    two = plan_cpu_binding(topology, 2, reserve_engine_core=True)
    # Each rank inside one node; the reserved core (7) comes from node 1, so 3 cores per rank.
    assert two.worker_cpus == ((0, 1, 2), (4, 5, 6))
    assert two.worker_num_threads == (3, 3)
    assert two.engine_cpus == (3, 7)
    two_all = plan_cpu_binding(topology, 2, reserve_engine_core=False)
    assert two_all.worker_cpus == ((0, 1, 2, 3), (4, 5, 6, 7)) and two_all.engine_cpus == ()
    four = plan_cpu_binding(topology, 4, reserve_engine_core=False)
    assert four.worker_cpus == ((0, 1), (2, 3), (4, 5), (6, 7))
    # A single rank stays on one node (local memory) rather than spanning both.
    one = plan_cpu_binding(topology, 1, reserve_engine_core=False)
    assert one.worker_cpus == ((0, 1, 2, 3),) and one.engine_cpus == (4, 5, 6, 7)
    three = plan_cpu_binding(topology, 3, reserve_engine_core=False)
    # k=2 gives 2 + 2 slices >= 3: ranks dealt round-robin, node 0 first.
    assert three.worker_cpus == ((0, 1), (2, 3), (4, 5)) and three.engine_cpus == (6, 7)


def test_restricted_affinity(eight_cores_smt: str, two_numa_nodes: str) -> None:
    # taskset / cgroup limits: only the allowed logical CPUs count, and a core whose sibling is
    # not allowed keeps just the allowed one.
    topology = read_cpu_topology(eight_cores_smt, allowed_cpus={2, 3, 4, 10})
    assert topology.cores == ((2, 10), (3,), (4,))
    plan = plan_cpu_binding(topology, 2, reserve_engine_core=True)
    assert plan.worker_cpus == ((2, 10), (3,)) and plan.engine_cpus == (4,)
    numa = read_cpu_topology(two_numa_nodes, allowed_cpus={3, 4, 5})
    assert numa.cores == ((3,), (4,), (5,)) and numa.core_nodes == (0, 1, 1)
    plan = plan_cpu_binding(numa, 1, reserve_engine_core=False)
    assert plan.worker_cpus == ((4, 5),)  # the node with more allowed cores
    with pytest.raises(ValueError, match="allowed_cpus='20-21'"):
        read_cpu_topology(eight_cores_smt, allowed_cpus={20, 21})


def test_plans_never_share_a_core(two_numa_nodes: str, eight_cores_smt: str) -> None:
    for root, num_cpus in ((two_numa_nodes, 8), (eight_cores_smt, 16)):
        topology = read_cpu_topology(root, allowed_cpus=set(range(num_cpus)))
        for world_size in range(1, topology.num_cores + 1):
            for reserve in (False, True):
                plan = plan_cpu_binding(topology, world_size, reserve_engine_core=reserve)
                cpus = [cpu for slice_ in plan.worker_cpus for cpu in slice_] + list(plan.engine_cpus)
                assert sorted(cpus) == list(range(num_cpus))  # a partition of the allowed CPUs
                assert len(set(plan.worker_num_threads)) == 1  # equal cores per rank


def test_real_binding_applies_and_restores() -> None:
    allowed = os.sched_getaffinity(0)
    num_threads = torch.get_num_threads()
    topology = read_cpu_topology()
    plan = plan_cpu_binding(topology, 1, reserve_engine_core=False)
    try:
        apply_cpu_binding(plan, 0)
        assert os.sched_getaffinity(0) == set(plan.worker_cpus[0])
        assert torch.get_num_threads() == plan.worker_num_threads[0]
        with pytest.raises(ValueError, match="rank=1"):
            apply_cpu_binding(plan, 1)
    finally:
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(num_threads)
