"""A model step that raises inside the 'mp' executor's worker processes fails only the requests of that
batch (finish_reason 'error'), and the engine keeps serving — as under 'uni'
(tests/engine/test_async_scheduling.py); a step that fails on some ranks while others wait for them in a
collective, or any failed step with pipeline parallelism, is fatal and leaves no process behind. The same
for the 'ray' executor is in test_ray_executor.py."""
from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.executor import multiproc
from pagedserve.executor.abstract import FatalExecutorError
from generation_helpers import generated_token_ids, random_prompts
from step_failure_injection import FailedBatches, assert_only_the_failed_batch_fails, failing_worker_entry
from worker_death_checks import pids_still_running

# Two seats: requests admitted after the failure must come out right too.
ENGINE = dict(dtype="float32", max_model_len=256, num_kv_blocks=128, max_num_batched_tokens=64, max_num_seqs=2)
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(6, 3, 70, seed=6)


@pytest.fixture(scope="module")
def reference(folder: str, prompts: list[list[int]]) -> list[list[int]]:
    return [list(tokens) for tokens in generated_token_ids(LLM(folder, **ENGINE), prompts, PARAMS)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_failed_step_fails_only_its_batch(folder: str, prompts: list[list[int]], reference: list[list[int]],
                                          async_scheduling: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # The fifth model step raises on both ranks (before its first collective); with async scheduling the
    # next step is already queued on the workers, and runs after the failed ranks are resumed.
    monkeypatch.setattr(multiproc, "run_worker_process", failing_worker_entry(fail_on_call=5, fail_ranks=(0, 1)))
    llm = LLM(folder, tensor_parallel_size=2, distributed_executor_backend="mp", async_scheduling=async_scheduling,
              **ENGINE)
    try:
        failed_batches = FailedBatches(llm.llm_engine.engine_core.executor, monkeypatch)
        assert_only_the_failed_batch_fails(llm, prompts, PARAMS, reference, failed_batches)
    finally:
        llm.llm_engine.shutdown()


def test_step_failing_on_one_rank_only_is_fatal(folder: str, prompts: list[list[int]],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 1 fails its fifth model step; rank 0 runs it and waits in its first collective for rank 1, which
    # is held: rank 0 never answers, so the workers are out of step.
    monkeypatch.setattr(multiproc, "run_worker_process", failing_worker_entry(fail_on_call=5, fail_ranks=(1,)))
    monkeypatch.setattr(multiproc, "PEER_STEP_GRACE_S", 2.0)
    llm = LLM(folder, tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE)
    processes = list(llm.llm_engine.engine_core.executor.processes)
    try:
        with pytest.raises(FatalExecutorError, match=r"(?s)worker rank\(s\) \[0\] did not finish the step within 2 s"
                                                     r".*out of step.*raised on worker rank 1 .*injected step failure"):
            generated_token_ids(llm, prompts, PARAMS)
    finally:
        llm.llm_engine.shutdown()
    assert pids_still_running([process.pid for process in processes]) == []


def test_failed_step_with_pipeline_parallelism_is_fatal(folder: str, prompts: list[list[int]],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multiproc, "run_worker_process", failing_worker_entry(fail_on_call=5, fail_ranks=(0, 1)))
    llm = LLM(folder, pipeline_parallel_size=2, distributed_executor_backend="mp", **ENGINE)
    processes = list(llm.llm_engine.engine_core.executor.processes)
    try:
        with pytest.raises(FatalExecutorError, match="with pipeline parallelism a failed step is fatal"):
            generated_token_ids(llm, prompts, PARAMS)
    finally:
        llm.llm_engine.shutdown()
    assert pids_still_running([process.pid for process in processes]) == []
