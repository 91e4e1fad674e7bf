"""A failing model step inside the workers of the 'mp' and 'ray' executors, injected the way
tests/engine/test_async_scheduling.py injects one under 'uni': the Nth model step (the forward, or the
greedy decode from the batch, whichever runs it) raises before it starts — so before any collective.

Workers live in other processes, where a monkeypatch of the test process does not reach. A test swaps
the executor's worker entry (`multiproc.run_worker_process`) or actor class (`ray_executor.RayWorkerActor`)
for one made here, which installs the failure in the Worker it builds. Spawned processes import this
module (they get the test process's sys.path); Ray's workers do not see the tests folder, so the actor
class travels by value.

Also: `FailedBatches`, which records in the engine process which steps raised WorkerStepError.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import ray.cloudpickle

from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.executor import multiproc
from pagedserve.executor.abstract import Executor, WorkerStepError
from pagedserve.executor.ray_executor import RayWorkerActor

# The real entry, kept before a test replaces the module attribute (the spawned child imports this module
# afresh, so it sees the real one too).
_run_worker_process = multiproc.run_worker_process


def inject_step_failure(model_runner: Any, fail_on_call: int) -> None:
    """Make the runner's `fail_on_call`-th model step (counting forwards and greedy decodes) raise."""
    calls = 0

    def failing_once(model_step: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == fail_on_call:
                raise RuntimeError(f"injected step failure (model step {calls})")
            return model_step(*args, **kwargs)
        return step

    model_runner.forward = failing_once(model_runner.forward)
    if model_runner.greedy_decode is not None:
        model_runner.greedy_decode = failing_once(model_runner.greedy_decode)


def _run_worker_process_failing(fail_on_call: int, fail_ranks: tuple[int, ...], config: Any, rank: int,
                                init_method: str, conn: Any) -> None:
    if rank in fail_ranks:
        from pagedserve.worker.worker import Worker

        build = Worker.__init__

        def build_then_inject(self: Worker, *args: Any, **kwargs: Any) -> None:
            build(self, *args, **kwargs)
            inject_step_failure(self.model_runner, fail_on_call)

        Worker.__init__ = build_then_inject  # type: ignore[method-assign]  # this worker process only
    _run_worker_process(config, rank, init_method, conn)


def failing_worker_entry(fail_on_call: int, fail_ranks: tuple[int, ...]) -> Callable[..., None]:
    """A `multiproc.run_worker_process` whose ranks in `fail_ranks` fail their `fail_on_call`-th model step."""
    return functools.partial(_run_worker_process_failing, fail_on_call, fail_ranks)


def failing_actor_class(fail_on_call: int, fail_ranks: tuple[int, ...]) -> type:
    """A `RayWorkerActor` whose ranks in `fail_ranks` fail their `fail_on_call`-th model step."""
    # Ray's workers cannot import this module: Ray pickles the class, and what it uses from here, by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

    class FailingStepActor(RayWorkerActor):
        def start(self, config: Any, rank: int, *args: Any, **kwargs: Any) -> bytes:
            ready = super().start(config, rank, *args, **kwargs)
            if rank in fail_ranks:
                inject_step_failure(self.worker.model_runner, fail_on_call)
            return ready

    return FailingStepActor


class FailedBatches:
    """Records, in the engine process, the request ids of every step whose execution raised WorkerStepError
    (synchronous steps and steps in flight alike)."""

    def __init__(self, executor: Executor, monkeypatch: Any) -> None:
        # id(scheduler output) -> (it, kept alive so that its id stays its own; its future or None; raised
        # synchronously)
        self._steps: dict[int, tuple[SchedulerOutput, Future | None, bool]] = {}
        execute_model, execute_model_async = executor.execute_model, executor.execute_model_async

        def recording_execute_model(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
            try:
                return execute_model(scheduler_output)
            except WorkerStepError:
                self._steps[id(scheduler_output)] = (scheduler_output, None, True)
                raise

        def recording_execute_model_async(scheduler_output: SchedulerOutput) -> Future:
            future = execute_model_async(scheduler_output)
            self._steps[id(scheduler_output)] = (scheduler_output, future, False)
            return future

        # ('mp' runs a synchronous step through execute_model_async: the same step is recorded once.)
        monkeypatch.setattr(executor, "execute_model", recording_execute_model)
        monkeypatch.setattr(executor, "execute_model_async", recording_execute_model_async)

    def batches(self) -> list[set[str]]:
        return [set(output.num_scheduled_tokens) for output, future, raised in self._steps.values()
                if raised or (future is not None and future.done()
                              and isinstance(future.exception(), WorkerStepError))]


def assert_only_the_failed_batch_fails(llm: Any, prompts: list[list[int]], params: Any,
                                       reference: list[list[int]], failed_batches: FailedBatches) -> None:
    """Generate `prompts`: exactly the requests of the one step that failed finish with 'error', every other
    one equals `reference`; then the engine serves new requests, and nothing is left in flight or cached."""
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    [failed] = failed_batches.batches()
    errors = {output.request_id for output in outputs if output.outputs[0].finish_reason == "error"}
    assert errors and errors == failed, (errors, failed)
    for index, output in enumerate(outputs):
        if output.request_id not in errors:
            assert list(output.outputs[0].token_ids) == reference[index], index
    # The engine keeps serving (the failed ranks were resumed, the workers are in step).
    again = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts[:2]], params, use_tqdm=False)
    assert [list(output.outputs[0].token_ids) for output in again] == reference[:2]
    engine = llm.llm_engine
    while engine.has_unfinished_requests():  # a step an async engine still has in flight
        engine.step()
    core = engine.engine_core
    assert core.kv_cache_manager.num_free_blocks == core.runtime_info.num_kv_blocks - 1
    assert core.scheduler.requests == {}
