"""RayExecutor ('ray'): one Ray actor per rank of the engine's TP x PP world — the multi-node path.

Start: the executor joins a Ray session (see `RaySession`), reserves one bundle per rank in a placement
group (PACK: as few nodes as possible), creates one `RayWorkerActor` per bundle, numbers the actors node
by node (consecutive ranks, i.e. TP groups, share a node when they fit), asks rank 0's actor for
its node IP and a free port *on that node* (rank 0 hosts the torch.distributed TCP store, so on several
nodes the address must be rank 0's node, never 127.0.0.1), then every actor builds its Worker in that
world and reports WorkerReady. Torch threads per actor: the node's cores over the ranks on that node
(what 'mp' does on one machine).

Per step: the SchedulerOutput is msgpack-encoded once by the WorkerCodec (the same bytes as 'mp'; the
step data is never a pickled Python object) and every actor's `execute_model` receives the same bytes
(inline in the call when small, else put in the object store once); the output rank (the first rank of the last pipeline stage)
returns the encoded StepResult, the other ranks None. Actor tasks from one caller run in submission order,
so several steps may be in flight (`execute_model_async`).

A step that raises in an actor is answered with an encoded StepFailed and the actor is held: its next
step waits until the executor calls `resume_steps` (a method of its own concurrency group, so it runs
while a step waits; see worker_messages.py). Once every rank has answered that step, the failed actors
are resumed and the step raises WorkerStepError, which fails only that batch — as under 'uni'. A rank that
does not answer within PEER_STEP_GRACE_S waits in a collective for the failed rank: that, and any failed
step with pipeline parallelism, is fatal.

Death: the executor waits on every rank's result with `ray.wait` in a poll loop (never an unbounded
`ray.get`): an actor that dies (RayActorError) or raises past the step (RayTaskError: a broken collective,
start-up) turns into FatalExecutorError as soon as Ray reports it, the dead peer named first, and every
actor is killed. Shutdown (normal, garbage collection or interpreter exit, through one weakref.finalize)
kills every actor, removes the placement group and ends the Ray session if this module started it and no
other executor still uses it.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import ray
import ray.exceptions
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagedserve.config.engine import EngineConfig
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.executor.abstract import Executor, FatalExecutorError, WorkerStepError
from pagedserve.executor.multiproc import output_rank
from pagedserve.executor.worker_messages import (PIPELINE_STEP_FAILURE_IS_FATAL, STEP_DONE, ExecuteModel,
                                                 StepFailed, StepResult, WorkerCodec, WorkerReady, answer_step,
                                                 describe_step_failures)
from pagedserve.platforms import current_platform
from pagedserve.worker.worker import RuntimeInfo

logger = logging.getLogger(__name__)

# Building the model can take a while on a busy machine; a step waits as long as it needs (deaths are
# noticed through Ray, not through a timeout).
STARTUP_TIMEOUT_S = 300.0
# How long the placement group may wait for free resources before the start fails.
PLACEMENT_TIMEOUT_S = 60.0
# ray.wait slice: bounds how long a wait blocks without looking at the other ranks or Ctrl-C.
POLL_INTERVAL_S = 0.5
# After one rank fails, how long to look for a dead peer (its death is usually the cause).
PEER_DEATH_GRACE_S = 1.0
# After a rank answers a step with StepFailed, how long the other ranks may take to answer that step.
# What is left of a step without the failed rank is collective-free (milliseconds); a rank still
# without an answer after this waits in a collective for the failed rank, and never will answer.
PEER_STEP_GRACE_S = 30.0
# How long shutdown waits for killed actor processes on this node to disappear.
SHUTDOWN_GRACE_S = 10.0
# Step bytes up to this size travel inline in each actor call (cheapest); larger ones are put in the
# object store once and shared by every actor (Ray's own inline limit is 100 KiB).
MAX_INLINE_STEP_BYTES = 64 * 1024
PLACEMENT_STRATEGY = "PACK"


def rank_order(node_ids: list[str], driver_node_id: str) -> list[int]:
    """Which actor (index into `node_ids`, the node of each actor) becomes rank 0, 1, ...: node by node,
    the driver's node first, then in order of appearance; actors of one node keep their order.

    Consecutive ranks — a TP group, the chattiest collectives — then share a node whenever it holds
    that many of them."""
    node_position = {driver_node_id: 0}
    for node_id in node_ids:
        node_position.setdefault(node_id, len(node_position))
    return sorted(range(len(node_ids)), key=lambda index: node_position[node_ids[index]])


# ---- the Ray session --------------------------------------------------------------------------------

class RaySession:
    """The Ray session executors run in, shared by every RayExecutor of this process.

    An already initialised session (the user called ray.init) is used and never shut down here.
    Otherwise the first executor connects to the cluster named by RAY_ADDRESS, or starts a local
    one (num_cpus = this machine's cores, no dashboard, worker logs not forwarded); the last executor
    to release it shuts it down (a connection to a remote cluster only disconnects this driver).
    """

    _lock = threading.Lock()
    _num_users = 0  # executors holding the session this module started (0: none started by us)

    @classmethod
    def acquire(cls) -> bool:
        """Make sure a session exists; True when the caller must `release` it later."""
        with cls._lock:
            if cls._num_users > 0 and ray.is_initialized():
                cls._num_users += 1
                return True
            cls._num_users = 0
            if ray.is_initialized():
                return False  # the user's session: theirs to end
            address = os.environ.get("RAY_ADDRESS")
            try:
                if address:
                    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
                else:
                    ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False,
                             log_to_driver=False, logging_level=logging.WARNING)
            except ConnectionError as error:
                raise ValueError(f"distributed_executor_backend='ray': cannot connect to the Ray cluster at "
                                 f"RAY_ADDRESS={address!r}: {error}") from error
            cls._num_users = 1
            return True

    @classmethod
    def release(cls) -> None:
        with cls._lock:
            if cls._num_users == 0:
                return
            cls._num_users -= 1
            if cls._num_users == 0 and ray.is_initialized():
                ray.shutdown()


# ---- the actor ----------------------------------------------------------------------------------------

# `resume_steps` runs in a concurrency group of its own (one thread) so that it can release a step that
# waits for it; every other method stays in the default group: one thread, calls in submission order.
CONTROL_CONCURRENCY_GROUP = "control"


class RayWorkerActor:
    """One rank: a Worker in a Ray actor. Control-plane calls (start-up) take Python arguments; each step
    arrives as WorkerCodec bytes and the output rank answers with WorkerCodec bytes."""

    def __init__(self) -> None:
        self.codec = WorkerCodec()
        self.worker: Any = None
        self.rank = 0
        self.is_output_rank = False
        # Cleared while this rank is held after a StepFailed answer; set again by resume_steps.
        self.resumed = threading.Event()
        self.resumed.set()

    def placement(self) -> tuple[str, str, int, int]:
        """(node id, node IP, pid, cores of the node) of this actor."""
        context = ray.get_runtime_context()
        return context.get_node_id(), ray.util.get_node_ip_address(), os.getpid(), os.cpu_count() or 1

    def free_port(self) -> int:
        """A TCP port free on this node right now (rank 0's TCP store binds it next)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return int(sock.getsockname()[1])

    def start(self, config: EngineConfig, rank: int, init_method: str, num_threads: int,
              is_output_rank: bool) -> bytes:
        """Join the world, build this rank's model shard and KV cache; the encoded WorkerReady."""
        from pagedserve.model_loader.checkpoint_slice import bytes_read
        from pagedserve.worker.worker import Worker

        torch.set_num_threads(num_threads)
        self.rank = rank
        self.is_output_rank = is_output_rank
        self.worker = Worker(config, rank=rank, distributed_init_method=init_method)
        info = self.worker.runtime_info
        parameters = list(self.worker.model_runner.model.parameters())
        return self.codec.encode(WorkerReady(
            rank=rank, pid=os.getpid(), num_kv_blocks=info.num_kv_blocks, kv_cache_bytes=info.kv_cache_bytes,
            attention_backend=info.attention_backend, weight_bytes_read=bytes_read(),
            num_parameters=sum(p.numel() for p in parameters),
            parameter_bytes=sum(p.numel() * p.element_size() for p in parameters)))

    def execute_model(self, data: bytes) -> bytes | None:
        """One step: the encoded StepResult on the output rank, None on the others, an encoded StepFailed
        where the step raised (then every later step waits for `resume_steps`)."""
        # Held after a failed step: a peer may still be in a collective of that step, which this step's
        # first collective would join. The executor resumes this rank once every rank answered it.
        self.resumed.wait()
        message = self.codec.decode_to_worker(data)
        if not isinstance(message, ExecuteModel):
            raise TypeError(f"expected an ExecuteModel message, got {type(message).__name__}")
        answer = answer_step(self.worker, message.scheduler_output, self.rank, self.is_output_rank)
        if answer is STEP_DONE:
            return None
        if isinstance(answer, StepFailed):
            self.resumed.clear()
        return self.codec.encode(answer)

    @ray.method(concurrency_group=CONTROL_CONCURRENCY_GROUP)
    def resume_steps(self) -> None:
        """Release the steps held after this rank's StepFailed (every rank answered the failed step)."""
        self.resumed.set()


# ---- the executor ---------------------------------------------------------------------------------------

@dataclass
class _RayResources:
    """What an executor holds in Ray (kept apart from the executor so its finalizer can release it)."""

    holds_session: bool = False
    placement_group: PlacementGroup | None = None
    actors: list[Any] = field(default_factory=list)
    local_pids: list[int] = field(default_factory=list)  # actor processes on the driver's node


def _pid_is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _release(resources: _RayResources) -> None:
    """Kill every actor, remove the placement group, wait for the local actor processes to go, and
    release the session. Idempotent; safe after the session is already gone (interpreter exit)."""
    actors, resources.actors = resources.actors, []
    group, resources.placement_group = resources.placement_group, None
    if ray.is_initialized():
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead: nothing to kill
                pass
        if group is not None:
            try:
                remove_placement_group(group)
            except Exception:
                pass
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    while any(_pid_is_running(pid) for pid in resources.local_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    resources.local_pids = []
    if resources.holds_session:
        resources.holds_session = False
        RaySession.release()


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel_config
        self.config = config
        self.world_size = parallel.world_size_per_engine
        self.output_rank = output_rank(parallel)
        self.codec = WorkerCodec()
        self.is_dead = False
        self._resources = _RayResources()
        # Registered before anything is created, so a failure half way through still releases it all.
        self._finalizer = weakref.finalize(self, _release, self._resources)
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    # ---- start ----------------------------------------------------------------------------------------
    def _start(self) -> None:
        resources = self._resources
        resources.holds_session = RaySession.acquire()
        bundle = {"CPU": 1.0}
        if current_platform().device_type == "cuda":
            bundle["GPU"] = 1.0
        self._check_cluster_fits(bundle)
        group = placement_group([dict(bundle) for _ in range(self.world_size)], strategy=PLACEMENT_STRATEGY)
        resources.placement_group = group
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise ValueError(
                f"distributed_executor_backend='ray': the placement group of tensor_parallel_size x "
                f"pipeline_parallel_size = {self.world_size} bundles of {bundle} could not be placed within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s (free in the cluster now: "
                f"{_resource_summary(ray.available_resources())})")
        actor_class = ray.remote(concurrency_groups={CONTROL_CONCURRENCY_GROUP: 1})(RayWorkerActor)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=rank)
            resources.actors.append(actor_class.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0.0), scheduling_strategy=strategy,
                max_restarts=0, max_task_retries=0).remote())
        placements = self._wait_all([actor.placement.remote() for actor in resources.actors], STARTUP_TIMEOUT_S,
                                    "start")
        driver_node = ray.get_runtime_context().get_node_id()
        order = rank_order([node_id for node_id, _, _, _ in placements], driver_node)
        resources.actors[:] = [resources.actors[index] for index in order]
        placements = [placements[index] for index in order]
        resources.local_pids = [pid for node_id, _, pid, _ in placements if node_id == driver_node]
        self.node_ids = [node_id for node_id, _, _, _ in placements]
        self.node_ips = [ip for _, ip, _, _ in placements]
        [port] = self._wait_all([resources.actors[0].free_port.remote()], STARTUP_TIMEOUT_S, "start")
        host = self.node_ips[0]
        init_method = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        ranks_per_node = {node_id: self.node_ids.count(node_id) for node_id in self.node_ids}
        config = ray.put(self.config)  # serialised once for every actor (start-up only; steps are msgpack)
        starts = []
        for rank, (actor, (node_id, _, _, node_cores)) in enumerate(zip(resources.actors, placements)):
            num_threads = max(1, node_cores // ranks_per_node[node_id])
            starts.append(actor.start.remote(config, rank, init_method, num_threads, rank == self.output_rank))
        ready_messages = [self.codec.decode_from_worker(data)
                          for data in self._wait_all(starts, STARTUP_TIMEOUT_S, "start")]
        for message in ready_messages:
            if not isinstance(message, WorkerReady):
                raise FatalExecutorError(f"a Ray worker sent {type(message).__name__} instead of WorkerReady")
        self.worker_pids = [message.pid for message in ready_messages]
        self.weight_bytes_read = [message.weight_bytes_read for message in ready_messages]
        self.parameter_bytes = [message.parameter_bytes for message in ready_messages]
        self.kv_cache_bytes = [message.kv_cache_bytes for message in ready_messages]
        self.num_parameters = [message.num_parameters for message in ready_messages]
        first = ready_messages[0]
        self.runtime_info = RuntimeInfo(num_kv_blocks=first.num_kv_blocks, kv_cache_bytes=first.kv_cache_bytes,
                                        attention_backend=first.attention_backend)
        logger.info("Ray executor: %d actors on node(s) %s, torch.distributed store at %s", self.world_size,
                    sorted(set(self.node_ips)), init_method)

    def _check_cluster_fits(self, bundle: dict[str, float]) -> None:
        """Fail at once, naming the knobs, when the whole cluster is too small for this engine's world."""
        total = ray.cluster_resources()
        for resource, amount in bundle.items():
            needed = amount * self.world_size
            if total.get(resource, 0.0) < needed:
                raise ValueError(
                    f"distributed_executor_backend='ray': tensor_parallel_size x pipeline_parallel_size = "
                    f"{self.world_size} actors need {needed:g} {resource} (one per rank) but the Ray cluster has "
                    f"{total.get(resource, 0.0):g} ({_resource_summary(total)})")

    # ---- steps ----------------------------------------------------------------------------------------------
    @property
    def actors(self) -> list[Any]:
        return list(self._resources.actors)

    @property
    def placement_group(self) -> PlacementGroup | None:
        return self._resources.placement_group

    @property
    def max_concurrent_batches(self) -> int:
        """Pipeline parallel: up to one micro-batch per stage in flight (as 'mp'); each actor runs its
        steps in submission order, so a stage starts step t+1 while later stages finish step t."""
        return max(super().max_concurrent_batches, self.config.parallel_config.pipeline_parallel_size)

    def _submit(self, scheduler_output: SchedulerOutput) -> list[Any]:
        """Send one step to every actor; the ObjectRefs of their answers, in rank order."""
        if self.is_dead:
            raise FatalExecutorError("the Ray executor is shut down after a worker failure")
        data = self.codec.encode(ExecuteModel(scheduler_output=scheduler_output))
        argument = data if len(data) <= MAX_INLINE_STEP_BYTES else ray.put(data)
        return [actor.execute_model.remote(argument) for actor in self._resources.actors]

    def _collect(self, refs: list[Any]) -> ModelRunnerOutput:
        """Wait for one submitted step on every rank; the output rank's ModelRunnerOutput.

        After a StepFailed answer the other ranks get PEER_STEP_GRACE_S to answer the same step; when all
        have, the failed ranks are resumed and WorkerStepError is raised (only this step's batch fails).
        """
        if self.is_dead:  # a step still in flight when an earlier one failed fatally
            raise FatalExecutorError("the Ray executor is shut down after a worker failure")
        answers = _StepAnswers(self.codec, self.output_rank, self.world_size)
        self._wait_all(refs, None, "step", answers)
        if answers.failures:
            message = answers.describe_failures()
            if self.config.parallel_config.pipeline_parallel_size > 1:
                self._fail(f"{message}\n{PIPELINE_STEP_FAILURE_IS_FATAL}")
            for failure in answers.failures:
                # Not waited for: the rank's next step waits for it, and a dead actor shows there.
                self._resources.actors[failure.rank].resume_steps.remote()
            raise WorkerStepError(message)
        if answers.result is None:
            self._fail(f"Ray worker rank {self.output_rank} sent no step result")
        return answers.result.output

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._collect(self._submit(scheduler_output))

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> "Future[ModelRunnerOutput]":
        """Submit the step now; the Future resolves when every rank has finished it. Steps resolve in
        submission order (the actors run them in that order); resolution happens on the caller's
        thread when it asks for the result, so no helper thread is needed."""
        refs = self._submit(scheduler_output)
        return _RayStepFuture(self, refs)

    def _wait_all(self, refs: list[Any], timeout: float | None, phase: str,
                  step_answers: "_StepAnswers | None" = None) -> list[Any]:
        """Every ref's value (refs in rank order), watching all ranks: the first Ray error becomes
        FatalExecutorError (after a short look for a dead peer, who is usually the cause).

        A step's `step_answers` takes each value as it arrives; once a rank answered with StepFailed,
        ranks still without an answer PEER_STEP_GRACE_S later are out of step: fatal too.
        """
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            grace_deadline = None if step_answers is None else step_answers.grace_deadline
            wait_s = POLL_INTERVAL_S
            for limit in (deadline, grace_deadline):
                if limit is not None:
                    wait_s = max(0.0, min(wait_s, limit - time.monotonic()))
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            for ref in ready:
                rank = rank_of[ref]
                failure = self._value_or_failure(ref, rank, results)
                if failure is not None:
                    self._fail(self._explain_failure(failure, pending, rank_of))
                if step_answers is not None and not step_answers.add(rank, results[rank]):
                    self._fail(f"Ray worker rank {rank} sent an unexpected answer to a step")
            if not pending:
                break
            if deadline is not None and time.monotonic() >= deadline:
                ranks = sorted(rank_of[ref] for ref in pending)
                self._fail(f"Ray worker rank(s) {ranks} did not finish {phase} within {timeout:.0f} s")
            grace_deadline = None if step_answers is None else step_answers.grace_deadline
            if grace_deadline is not None and time.monotonic() >= grace_deadline:
                ranks = sorted(rank_of[ref] for ref in pending)
                self._fail(f"Ray worker rank(s) {ranks} did not finish the step within {PEER_STEP_GRACE_S:.0f} s "
                           f"after it failed elsewhere (they wait in a collective for a failed rank): the "
                           f"workers are out of step, the engine cannot continue\n"
                           f"{step_answers.describe_failures()}")  # type: ignore[union-attr]
        return results

    def _value_or_failure(self, ref: Any, rank: int, results: list[Any]) -> "tuple[int, BaseException] | None":
        try:
            results[rank] = ray.get(ref, timeout=0)  # ready: returns at once
            return None
        except ray.exceptions.RayError as error:
            return rank, error

    def _explain_failure(self, failure: "tuple[int, BaseException]", pending: list[Any],
                         rank_of: dict[Any, int]) -> str:
        """A rank's exception is often only the echo of a peer's death (its collective broke): name the
        dead peer first when there is one."""
        rank, error = failure
        if not isinstance(error, ray.exceptions.RayActorError) and pending:
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=PEER_DEATH_GRACE_S)
            for ref in ready:
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayActorError as peer_error:
                    return (f"{self._describe(rank_of[ref], peer_error)}\n(then rank {rank} failed:\n"
                            f"{error})")
                except ray.exceptions.RayError:
                    pass
        return self._describe(rank, error)

    def _describe(self, rank: int, error: BaseException) -> str:
        pid = self.worker_pids[rank] if getattr(self, "worker_pids", None) else None
        where = f"Ray worker rank {rank}" + (f" (pid {pid}, node {self.node_ips[rank]})" if pid else "")
        if isinstance(error, ray.exceptions.RayActorError):
            return f"{where} died; the engine cannot continue ({type(error).__name__}: {error})"
        return f"{where} failed:\n{error}"

    def _fail(self, message: str) -> None:
        self.is_dead = True
        logger.error("Ray executor: %s", message)
        self.shutdown()
        raise FatalExecutorError(message)

    def shutdown(self) -> None:
        self._finalizer()


class _StepAnswers:
    """The ranks' answers to one step as they arrive: the output rank's StepResult, the StepFailed ones, and
    from the first StepFailed on, the deadline for the other ranks' answers."""

    def __init__(self, codec: WorkerCodec, output_rank: int, world_size: int) -> None:
        self._codec = codec
        self._output_rank = output_rank
        self._world_size = world_size
        self.result: StepResult | None = None
        self.failures: list[StepFailed] = []
        self.grace_deadline: float | None = None

    def add(self, rank: int, value: bytes | None) -> bool:
        """Take rank `rank`'s answer (None: a rank other than the output rank finished the step); False
        when it is not a valid answer."""
        if value is None:
            return rank != self._output_rank
        message = self._codec.decode_from_worker(value)
        if isinstance(message, StepFailed):
            self.failures.append(message)
            if self.grace_deadline is None:
                self.grace_deadline = time.monotonic() + PEER_STEP_GRACE_S
            return True
        if isinstance(message, StepResult) and rank == self._output_rank:
            self.result = message
            return True
        return False

    def describe_failures(self) -> str:
        return describe_step_failures(self.failures, self._world_size)


class _RayStepFuture(Future):
    """A Future over one step's ObjectRefs, resolved on the first `result()` / `exception()` call.

    Resolving means waiting on every rank (the executor's failure handling included), so a dead actor
    raises FatalExecutorError from `result()` instead of hanging. `done()` is true once every rank's
    answer is in Ray's hands, without fetching it."""

    def __init__(self, executor: RayExecutor, refs: list[Any]) -> None:
        super().__init__()
        self._executor = executor
        self._refs = refs
        self._resolve_lock = threading.Lock()

    def _resolve(self) -> None:
        with self._resolve_lock:
            if super().done():
                return
            try:
                self.set_result(self._executor._collect(self._refs))
            except BaseException as error:  # FatalExecutorError, or a decoding error
                self.set_exception(error)

    def done(self) -> bool:
        if super().done() or self._executor.is_dead:
            return True  # (when dead, result() raises at once)
        try:
            ready, _ = ray.wait(list(self._refs), num_returns=len(self._refs), timeout=0)
        except Exception:  # the session is gone: result() reports it without waiting
            return True
        return len(ready) == len(self._refs)

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        self._resolve()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._resolve()
        return super().exception(timeout)


def _resource_summary(resources: dict[str, float]) -> str:
    shown = {name: value for name, value in resources.items() if name in ("CPU", "GPU")}
    return ", ".join(f"{name}={value:g}" for name, value in sorted(shown.items())) or "no CPU/GPU"
