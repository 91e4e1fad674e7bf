"""The 'ray' executor: TP=2 as two Ray actors on a local Ray cluster equals one process, token for token;
a step that raises in the actors fails only its batch (finish_reason 'error') and the engine goes on, as
under 'uni'; a killed actor, or a step failing on one rank while the other waits for it in a collective,
raises FatalExecutorError promptly; nothing of ours is left behind.

Ray is a required test dependency here: no importorskip. One Ray session serves the whole module: the
`ray_session` fixture starts it the way a user would (ray.init before building the engine) with 4 logical
CPUs, so two TP=2 engines fit at once; engines must then leave it running. The path where the executor
starts (and ends) its own local cluster is tested in test_ray_session.py.
"""
from __future__ import annotations

import os
import random
import sys
import time

import pytest
import ray
from ray.util import placement_group_table

from pagedserve import LLM, SamplingParams
from pagedserve.core.scheduler_output import CachedRequestData, SchedulerOutput
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.executor import ray_executor
from pagedserve.executor.abstract import FatalExecutorError, WorkerStepError
from pagedserve.executor.ray_executor import RayExecutor
from generation_helpers import generated_token_ids, random_prompts
from step_failure_injection import FailedBatches, assert_only_the_failed_batch_fails, failing_actor_class
from worker_death_checks import kill_worker_mid_generation, pids_still_running

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
ENGINE_KWARGS = dict(max_model_len=256, num_kv_blocks=96, max_num_batched_tokens=64)


def _prompts() -> list[dict]:
    rng = random.Random(5)
    return [{"prompt_token_ids": [rng.randrange(8, 600) for _ in range(rng.randint(3, 70))]} for _ in range(5)]


def _tokens(llm: LLM, params: SamplingParams | list[SamplingParams] = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def folder(tiny_model_dir) -> str:
    return tiny_model_dir("llama")  # float32 weights, dtype 'auto' keeps float32


@pytest.fixture(scope="module")
def reference(folder: str) -> LLM:
    return LLM(folder, **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def ray_session():
    assert not ray.is_initialized(), "another test left a Ray session behind"
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_tp2(folder: str, ray_session: None):
    llm = LLM(folder, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE_KWARGS)
    yield llm
    llm.llm_engine.shutdown()


def test_ray_tp2_greedy_equals_single_process(ray_tp2: LLM, reference: LLM, folder: str) -> None:
    executor = ray_tp2.llm_engine.engine_core.executor
    assert isinstance(executor, RayExecutor)
    assert len(executor.actors) == 2
    assert len(set(executor.worker_pids)) == 2 and os.getpid() not in executor.worker_pids
    assert placement_group_table(executor.placement_group)["state"] == "CREATED"
    expected = _tokens(reference)
    assert all(len(tokens) == 40 for tokens in expected)
    assert _tokens(ray_tp2) == expected
    # Seeded top-k sampling too: both actors sample the same gathered logits with the same generators.
    seeded = [SamplingParams(temperature=0.9, top_k=20, seed=11 + i, max_tokens=12, ignore_eos=True)
              for i in range(5)]
    assert _tokens(ray_tp2, seeded) == _tokens(reference, seeded)
    # Sharded loading works inside actors: each rank read about half the checkpoint.
    file_bytes = os.path.getsize(os.path.join(folder, "model.safetensors"))
    for bytes_read in executor.weight_bytes_read:
        assert 0.45 * file_bytes < bytes_read < 0.55 * file_bytes, (bytes_read, file_bytes)


def test_killed_actor_raises_promptly_and_leaves_nothing(ray_tp2: LLM, reference: LLM, folder: str) -> None:
    # Async scheduling: the actor dies with steps in flight (execute_model_async futures).
    engine = LLMEngine.from_kwargs(folder, tensor_parallel_size=2, distributed_executor_backend="ray",
                                   max_model_len=256, num_kv_blocks=64, async_scheduling=True)
    executor = engine.engine_core.executor
    assert executor.max_concurrent_batches == 2
    pids = list(executor.worker_pids)
    group = executor.placement_group
    try:
        kill_worker_mid_generation(engine, pids[1], rank=1)
    finally:
        engine.shutdown()
    assert pids_still_running(pids) == []
    assert placement_group_table(group)["state"] == "REMOVED"
    # The module engine shares the Ray session and is untouched.
    assert ray.is_initialized()
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert _tokens(ray_tp2, short) == _tokens(reference, short)


# Slow: a failing step under Ray is test_failed_step_fails_only_its_batch; async scheduling over the mp executor's
# ranks is tests/engine/test_async_scheduling.py::test_multiprocess_tp2_async_equal.
@pytest.mark.slow
def test_async_scheduling_equals_single_process_then_a_failing_step_fails_alone(ray_tp2: LLM, reference: LLM,
                                                                                 folder: str) -> None:
    llm = LLM(folder, tensor_parallel_size=2, distributed_executor_backend="ray", async_scheduling=True,
              **ENGINE_KWARGS)
    engine = llm.llm_engine
    executor = engine.engine_core.executor
    # Steps submitted ahead through execute_model_async (futures fed from the actors' ObjectRefs).
    assert engine.engine_core.batch_queue is not None and executor.max_concurrent_batches == 2
    assert _tokens(llm) == _tokens(reference)
    pids = list(executor.worker_pids)
    # A step for a request no worker holds: every rank raises inside execute_model, before any collective.
    bogus = SchedulerOutput(scheduled_new_requests=[],
                            scheduled_cached_requests=CachedRequestData(request_ids=["missing"],
                                                                        new_block_ids=[[]],
                                                                        num_computed_tokens=[1]),
                            num_scheduled_tokens={"missing": 1}, total_num_scheduled_tokens=1)
    try:
        with pytest.raises(WorkerStepError, match=r"(?s)raised on worker ranks \[0, 1\].*KeyError: 'missing'"):
            executor.execute_model(bogus)
        # Both ranks were resumed: the executor goes on.
        assert _tokens(llm) == _tokens(reference)
    finally:
        engine.shutdown()
    assert pids_still_running(pids) == []


FAILURE_ENGINE_KWARGS = dict(ENGINE_KWARGS, max_num_seqs=2)  # two seats: later requests start after the failure
FAILURE_PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_failed_step_fails_only_its_batch(ray_tp2: LLM, reference: LLM, folder: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # As tests/engine/test_async_scheduling.py does under 'uni': the fifth model step raises, here on both
    # actors; with async scheduling the next step is already queued on them and waits for resume_steps.
    prompts = random_prompts(6, 3, 70, seed=6)
    expected = [list(tokens) for tokens in generated_token_ids(reference, prompts, FAILURE_PARAMS)]
    monkeypatch.setattr(ray_executor, "RayWorkerActor", failing_actor_class(fail_on_call=5, fail_ranks=(0, 1)))
    llm = LLM(folder, tensor_parallel_size=2, distributed_executor_backend="ray", async_scheduling=True,
              **FAILURE_ENGINE_KWARGS)
    pids = list(llm.llm_engine.engine_core.executor.worker_pids)
    try:
        failed_batches = FailedBatches(llm.llm_engine.engine_core.executor, monkeypatch)
        assert_only_the_failed_batch_fails(llm, prompts, FAILURE_PARAMS, expected, failed_batches)
    finally:
        llm.llm_engine.shutdown()
    assert pids_still_running(pids) == []


def test_step_failing_on_one_rank_only_is_fatal(ray_tp2: LLM, folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 1 fails its fifth model step; rank 0 runs it and waits in its first collective for rank 1, which is
    # held: rank 0 never answers, so the actors are out of step.
    monkeypatch.setattr(ray_executor, "RayWorkerActor", failing_actor_class(fail_on_call=5, fail_ranks=(1,)))
    monkeypatch.setattr(ray_executor, "PEER_STEP_GRACE_S", 2.0)
    llm = LLM(folder, tensor_parallel_size=2, distributed_executor_backend="ray", **FAILURE_ENGINE_KWARGS)
    executor = llm.llm_engine.engine_core.executor
    pids, group = list(executor.worker_pids), executor.placement_group
    try:
        with pytest.raises(FatalExecutorError, match=r"(?s)Ray worker rank\(s\) \[0\] did not finish the step "
                                                     r"within 2 s.*out of step.*raised on worker rank 1 .*"
                                                     r"injected step failure"):
            generated_token_ids(llm, random_prompts(6, 3, 70, seed=6), FAILURE_PARAMS)
    finally:
        llm.llm_engine.shutdown()
    assert pids_still_running(pids) == []
    assert placement_group_table(group)["state"] == "REMOVED"


def test_pipeline_parallel_under_ray_equals_single_process(ray_tp2: LLM, reference: LLM, folder: str) -> None:
    llm = LLM(folder, pipeline_parallel_size=2, distributed_executor_backend="ray", **ENGINE_KWARGS)
    try:
        executor = llm.llm_engine.engine_core.executor
        # The last stage's first rank answers; two micro-batches may be in flight.
        assert executor.output_rank == 1 and executor.max_concurrent_batches == 2
        assert _tokens(llm) == _tokens(reference)
    finally:
        llm.llm_engine.shutdown()


def test_cluster_too_small_is_rejected_naming_the_knobs(ray_tp2: LLM, tiny_model_dir) -> None:
    # 8 heads, so tensor_parallel_size=8 is valid for the model; it is not capped by this machine's cores
    # ('ray' may span machines) but by the Ray cluster's 4 CPUs, at once.
    folder = tiny_model_dir("llama", num_attention_heads=8)
    groups_before = set(placement_group_table())
    with pytest.raises(ValueError, match=r"tensor_parallel_size x pipeline_parallel_size = 8 actors need 8 CPU "
                                         r"\(one per rank\) but the Ray cluster has 4"):
        LLM(folder, tensor_parallel_size=8, distributed_executor_backend="ray", max_model_len=128,
            num_kv_blocks=32)
    assert set(placement_group_table()) == groups_before  # no placement group was made
    assert ray.is_initialized()  # the user's session stays


def test_busy_cluster_fails_the_start_and_removes_its_placement_group(ray_tp2: LLM, folder: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # The module engine holds 2 of the 4 CPUs: a TP=4 engine fits the cluster but cannot be placed now.
    monkeypatch.setattr(ray_executor, "PLACEMENT_TIMEOUT_S", 1.0)
    groups_before = set(placement_group_table())
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"placement group of tensor_parallel_size x pipeline_parallel_size = 4 "
                                         r"bundles .* could not be placed within 1 s \(free in the cluster now: "
                                         r"CPU=2\)"):
        LLM(folder, tensor_parallel_size=4, distributed_executor_backend="ray", max_model_len=128,
            num_kv_blocks=32)
    assert time.monotonic() - start < 20.0
    new_groups = set(placement_group_table()) - groups_before
    assert len(new_groups) == 1
    assert all(placement_group_table()[group_id]["state"] == "REMOVED" for group_id in new_groups)
    assert ray.available_resources().get("CPU") == 2.0  # its reservation is released


def test_rank_order_numbers_actors_node_by_node_driver_node_first() -> None:
    assert ray_executor.rank_order(["a", "a"], "a") == [0, 1]
    # Bundles interleaved over two nodes: each node's actors get consecutive ranks (TP groups stay local).
    assert ray_executor.rank_order(["b", "a", "b", "a"], "a") == [1, 3, 0, 2]
    assert ray_executor.rank_order(["c", "b", "c", "b"], "a") == [0, 2, 1, 3]  # driver node holds none


def test_missing_ray_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, folder: str) -> None:
    monkeypatch.delitem(sys.modules, "pagedserve.executor.ray_executor")
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ModuleNotFoundError
    with pytest.raises(ImportError, match="distributed_executor_backend='ray' needs the ray package"):
        LLM(folder, tensor_parallel_size=2, distributed_executor_backend="ray", max_model_len=128,
            num_kv_blocks=32)


# Slow: the executor-independent worker path is covered by the 'mp' offload test in
# tests/models/test_deepseek_sparse_kv_offload.py; this adds the Ray actor's shutdown.
@pytest.mark.slow
def test_sparse_kv_offload_in_a_ray_actor_equals_one_process(ray_session, tiny_model_dir, tmp_path) -> None:
    """The worker maps the offload tier from an unlinked file, so an actor killed at shutdown leaves nothing."""
    folder = tiny_model_dir("deepseek-v32")
    kwargs = dict(dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    prompts = [p["prompt_token_ids"] for p in _prompts()[:2]]
    expected = generated_token_ids(LLM(folder, **kwargs), prompts, GREEDY)
    llm = LLM(folder, distributed_executor_backend="ray",
              sparse_kv_offload={"num_resident_blocks": 2, "tier_directory": str(tmp_path)}, **kwargs)
    assert generated_token_ids(llm, prompts, GREEDY) == expected
    assert llm.llm_engine.engine_core.make_stats().sparse_kv_offload.num_block_misses > 0
    llm.llm_engine.shutdown()
    assert os.listdir(tmp_path) == []
