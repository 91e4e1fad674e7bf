"""CPU binding: pin each worker rank (and its torch threads) to its own physical cores.

Three steps, each a plain function so the math is testable against fabricated `/sys` trees:

1. `read_cpu_topology(sys_root, allowed_cpus)` reads the logical CPUs, their physical cores (SMT
   siblings share `(physical_package_id, core_id)`) and NUMA nodes from `/sys/devices/system/{cpu,node}`,
   keeping only the CPUs this process may run on (`os.sched_getaffinity`, which honours cgroups/taskset).
2. `plan_cpu_binding(topology, world_size, reserve_engine_core)` gives every rank the same number of
   whole physical cores (equal cores: a TP step waits for its slowest rank), never sharing a core between
   ranks, each rank inside one NUMA node when the nodes allow it. When cores are to spare and asked for,
   one core is kept out of every worker slice for the engine loop / HTTP front end.
3. `apply_cpu_binding(plan, rank)` calls `os.sched_setaffinity` with the rank's logical CPUs (SMT
   siblings included: the OS may run helper threads there) and sets torch's intra-op threads to the
   rank's number of physical cores (one compute thread per core: SMT siblings share the FPUs).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DEFAULT_SYS_ROOT = "/sys"


@dataclass(frozen=True)
class CpuTopology:
    """The CPUs a process may use, grouped by physical core and NUMA node.

    `cores[i]` is one physical core as the sorted tuple of its allowed logical CPU ids; cores are sorted
    by their first id. `core_nodes[i]` is the NUMA node of `cores[i]` (0 when /sys has no node directory).
    """

    cores: tuple[tuple[int, ...], ...]
    core_nodes: tuple[int, ...]

    @property
    def num_cores(self) -> int:
        return len(self.cores)

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.core_nodes)))

    def cores_of_node(self, node_id: int) -> list[tuple[int, ...]]:
        return [core for core, node in zip(self.cores, self.core_nodes) if node == node_id]


@dataclass(frozen=True)
class CpuBindingPlan:
    """Per rank: its logical CPUs and its torch thread count; plus the CPUs left to the engine loop."""

    worker_cpus: tuple[tuple[int, ...], ...]
    worker_num_threads: tuple[int, ...]
    # Logical CPUs in no worker slice (the reserved core and any remainder); the engine / server side.
    engine_cpus: tuple[int, ...]

    def describe(self, rank: int) -> str:
        return (f"rank {rank}: cpus {format_cpu_list(self.worker_cpus[rank])} "
                f"({self.worker_num_threads[rank]} torch threads); engine/front end: "
                f"{format_cpu_list(self.engine_cpus) or 'shared'}")


def parse_cpu_list(text: str) -> list[int]:
    """Parse the kernel's list format ('0-3,8,10-11') into sorted ids; '' gives []."""
    ids: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            first, last = part.split("-", 1)
            ids.update(range(int(first), int(last) + 1))
        else:
            ids.add(int(part))
    return sorted(ids)


def format_cpu_list(cpu_ids: tuple[int, ...] | list[int]) -> str:
    """The inverse of parse_cpu_list: sorted ids as ranges ('0-3,8')."""
    ranges: list[str] = []
    ids = sorted(cpu_ids)
    start = 0
    while start < len(ids):
        end = start
        while end + 1 < len(ids) and ids[end + 1] == ids[end] + 1:
            end += 1
        ranges.append(str(ids[start]) if start == end else f"{ids[start]}-{ids[end]}")
        start = end + 1
    return ",".join(ranges)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def read_cpu_topology(sys_root: str = DEFAULT_SYS_ROOT, allowed_cpus: set[int] | None = None) -> CpuTopology:
    """Physical cores and NUMA nodes of the allowed CPUs (default: `os.sched_getaffinity(0)`).

    A CPU without topology files counts as its own core; CPUs missing from every node file belong to
    node 0. Raises ValueError when none of the allowed CPUs is online.
    """
    if allowed_cpus is None:
        allowed_cpus = set(os.sched_getaffinity(0))
    cpu_root = os.path.join(sys_root, "devices", "system", "cpu")
    online_text = _read(os.path.join(cpu_root, "online"))
    if online_text is not None:
        online = set(parse_cpu_list(online_text))
    else:
        online = {int(name[3:]) for name in os.listdir(cpu_root) if name[:3] == "cpu" and name[3:].isdigit()}
    cpu_ids = sorted(online & set(allowed_cpus))
    if not cpu_ids:
        raise ValueError(f"allowed_cpus={format_cpu_list(sorted(allowed_cpus))!r} has no online CPU "
                         f"(online: {format_cpu_list(sorted(online))!r})")

    # Logical CPUs sharing (package, core id) are SMT siblings of one physical core.
    core_members: dict[tuple[int, int], list[int]] = {}
    for cpu_id in cpu_ids:
        topology = os.path.join(cpu_root, f"cpu{cpu_id}", "topology")
        package_id = _read(os.path.join(topology, "physical_package_id"))
        core_id = _read(os.path.join(topology, "core_id"))
        key = (int(package_id), int(core_id)) if package_id is not None and core_id is not None else (-1, -1 - cpu_id)
        core_members.setdefault(key, []).append(cpu_id)
    cores = sorted(tuple(sorted(members)) for members in core_members.values())

    node_of_cpu: dict[int, int] = {}
    node_root = os.path.join(sys_root, "devices", "system", "node")
    if os.path.isdir(node_root):
        for name in os.listdir(node_root):
            if name[:4] != "node" or not name[4:].isdigit():
                continue
            cpulist = _read(os.path.join(node_root, name, "cpulist"))
            for cpu_id in parse_cpu_list(cpulist or ""):
                node_of_cpu[cpu_id] = int(name[4:])
    core_nodes = tuple(node_of_cpu.get(core[0], 0) for core in cores)
    return CpuTopology(cores=tuple(cores), core_nodes=core_nodes)


def _split_evenly(num_items: int, num_parts: int) -> list[int]:
    """Part sizes differing by at most one, larger parts first."""
    base, extra = divmod(num_items, num_parts)
    return [base + (1 if index < extra else 0) for index in range(num_parts)]


def plan_cpu_binding(topology: CpuTopology, world_size: int, reserve_engine_core: bool = True) -> CpuBindingPlan:
    """Give each of `world_size` ranks `k` distinct physical cores, the same `k` for all.

    With `reserve_engine_core` and more cores than ranks, one core (the last core of the largest NUMA
    node) is kept for the engine loop / front end first. Then `k` is the largest count such that every
    rank gets `k` cores from a single node (ranks are dealt round-robin over the nodes that can hold
    one more slice, largest first); on one node that is simply `cores // world_size`. `k = 1` always
    fits, so every rank always stays inside one node. A single rank on a multi-node
    machine stays on one node (its memory stays local). Cores no rank gets are listed in `engine_cpus`.
    Raises ValueError when there are fewer allowed physical cores than ranks.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an integer >= 1")
    if topology.num_cores < world_size:
        raise ValueError(f"world_size={world_size} ranks need as many physical cores, but only "
                         f"{topology.num_cores} are allowed ({format_cpu_list([c for core in topology.cores for c in core])})")
    nodes = {node: topology.cores_of_node(node) for node in topology.node_ids}
    reserved: list[tuple[int, ...]] = []
    if reserve_engine_core and topology.num_cores > world_size:
        largest = max(nodes, key=lambda node: (len(nodes[node]), node))
        reserved.append(nodes[largest].pop())
        if not nodes[largest]:
            del nodes[largest]

    slices = _numa_local_slices(nodes, world_size)
    assigned = {core for cores in slices for core in cores}
    leftover = [core for cores in nodes.values() for core in cores if core not in assigned]
    engine_cpus = tuple(sorted(cpu for core in (*reserved, *leftover) for cpu in core))
    return CpuBindingPlan(
        worker_cpus=tuple(tuple(sorted(cpu for core in cores for cpu in core)) for cores in slices),
        worker_num_threads=tuple(len(cores) for cores in slices),
        engine_cpus=engine_cpus,
    )


def _numa_local_slices(nodes: dict[int, list[tuple[int, ...]]],
                       world_size: int) -> list[list[tuple[int, ...]]]:
    """Equal-size core slices, each inside one node, as large as possible (needs >= world_size cores)."""
    node_ids = sorted(nodes)
    if len(node_ids) == 1:
        cores = nodes[node_ids[0]]
        per_rank = len(cores) // world_size
        return [cores[rank * per_rank:(rank + 1) * per_rank] for rank in range(world_size)]
    # Try every per-rank size k from the largest down: ranks fit when sum(floor(c_i / k)) >= world_size.
    largest_node = max(len(cores) for cores in nodes.values())
    for per_rank in range(largest_node, 0, -1):
        capacity = {node: len(nodes[node]) // per_rank for node in node_ids}
        if sum(capacity.values()) < world_size:
            continue
        # Fill nodes in order of capacity (largest first, then id), spreading ranks across nodes
        # round-robin so neighbouring ranks (a TP group) use every node's memory bandwidth.
        slices_by_node: dict[int, int] = {node: 0 for node in node_ids}
        order = sorted(node_ids, key=lambda node: (-capacity[node], node))
        remaining = world_size
        while remaining:
            for node in order:
                if remaining and slices_by_node[node] < capacity[node]:
                    slices_by_node[node] += 1
                    remaining -= 1
        slices: list[list[tuple[int, ...]]] = []
        for node in node_ids:
            cores = nodes[node]
            for index in range(slices_by_node[node]):
                slices.append(cores[index * per_rank:(index + 1) * per_rank])
        return slices
    raise AssertionError("unreachable: k = 1 fits whenever there are >= world_size cores")


def apply_cpu_binding(plan: CpuBindingPlan, rank: int, set_num_threads: bool = True) -> None:
    """Pin this process to rank `rank`'s CPUs and (optionally) size torch's intra-op pool to its cores."""
    if not 0 <= rank < len(plan.worker_cpus):
        raise ValueError(f"rank={rank} must be in [0, {len(plan.worker_cpus) - 1}]")
    os.sched_setaffinity(0, set(plan.worker_cpus[rank]))
    if set_num_threads:
        import torch

        torch.set_num_threads(plan.worker_num_threads[rank])
    logger.info("CPU binding: %s", plan.describe(rank))


def bind_worker_cpus(rank: int, world_size: int, keep_num_threads: bool,
                     sys_root: str = DEFAULT_SYS_ROOT) -> CpuBindingPlan:
    """Read the topology, plan for `world_size` ranks and bind rank `rank` (the worker's entry point).

    A core is kept for the engine loop / front end only when the workers run in their own processes
    (`world_size > 1`): with one in-process worker the engine loop runs on the worker's own thread, so
    a reserved core would sit idle. `keep_num_threads`: the user set num_cpu_threads; leave it.
    """
    topology = read_cpu_topology(sys_root)
    plan = plan_cpu_binding(topology, world_size, reserve_engine_core=world_size > 1)
    apply_cpu_binding(plan, rank, set_num_threads=not keep_num_threads)
    return plan


__all__ = ["CpuBindingPlan", "CpuTopology", "apply_cpu_binding", "bind_worker_cpus", "format_cpu_list",
           "parse_cpu_list", "plan_cpu_binding", "read_cpu_topology"]
