"""async_scheduling=True (step t+1 scheduled while step t runs) vs synchronous scheduling: identical
outputs (float32 tiny llama), and the batch queue's bookkeeping under stops, preemption, aborts and a
failing step."""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest

from pagedserve import LLM, SamplingParams
from generation_helpers import random_prompts

ENGINE = dict(dtype="float32", max_model_len=256, num_kv_blocks=128, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def folder(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


def _prompts(num: int, seed: int, low: int = 3, high: int = 70) -> list[list[int]]:
    return random_prompts(num, low, high, seed)


def _generate(llm: LLM, prompts: list[list[int]], params) -> list[list[list[int]]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def _drain(llm: LLM) -> None:
    """Collect the steps still in flight (a finished generate may leave a discarded one queued)."""
    engine = llm.llm_engine
    while engine.has_unfinished_requests():
        engine.step()


def _assert_all_blocks_free(llm: LLM) -> None:
    _drain(llm)
    core = llm.llm_engine.engine_core
    assert not core.batch_queue, "steps left in flight"
    assert core.kv_cache_manager.num_free_blocks == core.runtime_info.num_kv_blocks - 1
    assert core.scheduler.requests == {}


def test_async_engine_keeps_a_two_step_queue(folder: str) -> None:
    llm = LLM(folder, async_scheduling=True, **ENGINE)
    core = llm.llm_engine.engine_core
    assert core.executor.max_concurrent_batches == 2 and core.batch_queue is not None
    assert LLM(folder, **ENGINE).llm_engine.engine_core.batch_queue is None


def test_greedy_mixed_max_tokens_equal(folder: str) -> None:
    prompts = _prompts(10, seed=0)
    rng = random.Random(1)
    params = [SamplingParams(temperature=0.0, max_tokens=rng.choice([1, 2, 5, 33, 48]), ignore_eos=True)
              for _ in prompts]
    reference = _generate(LLM(folder, **ENGINE), prompts, params)
    llm = LLM(folder, async_scheduling=True, **ENGINE)
    assert _generate(llm, prompts, params) == reference
    assert [len(o[0]) for o in reference] == [p.max_tokens for p in params]
    _assert_all_blocks_free(llm)


def test_stop_strings_stop_tokens_eos_n_and_seeds_equal(folder: str, tmp_path) -> None:
    prompts = _prompts(6, seed=2, low=5, high=40)
    probe = _generate(LLM(folder, **ENGINE), prompts, SamplingParams(temperature=0.0, max_tokens=40,
                                                                      ignore_eos=True))
    # An "EOS" the model really produces mid-way: a copy of the model whose generation config lists it.
    eos_token = probe[0][0][12]
    eos_folder = str(tmp_path / "eos-model")
    shutil.copytree(folder, eos_folder)
    with open(os.path.join(eos_folder, "generation_config.json")) as f:
        generation_config = json.load(f)
    generation_config["eos_token_id"] = [generation_config["eos_token_id"], eos_token]
    with open(os.path.join(eos_folder, "generation_config.json"), "w") as f:
        json.dump(generation_config, f)
    # A stop string taken from one request's text, and a stop token from another's tokens.
    text = LLM(folder, **ENGINE).get_tokenizer().decode(probe[1][0][10:14])
    params = [
        SamplingParams(temperature=0.0, max_tokens=40),  # stops at the EOS
        SamplingParams(temperature=0.0, max_tokens=40, stop=[text.strip()[:3]], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[probe[2][0][20]], ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=33, seed=11, n=3, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=35, seed=5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=36, n=2, ignore_eos=True),
    ]
    reference_llm = LLM(eos_folder, **ENGINE)
    reference = _generate(reference_llm, prompts, params)
    llm = LLM(eos_folder, async_scheduling=True, **ENGINE)
    assert _generate(llm, prompts, params) == reference
    # The stops really cut the outputs short.
    assert len(reference[0][0]) <= 13 and reference[0][0][-1] == eos_token
    assert len(reference[1][0]) < 40 and len(reference[2][0]) <= 21
    assert len(reference[3]) == 3 and all(len(c) == 33 for c in reference[3])
    _assert_all_blocks_free(llm)


def test_preemption_under_a_tiny_kv_cache_equal(folder: str) -> None:
    prompts = _prompts(6, seed=3, low=20, high=50)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reference = _generate(LLM(folder, **ENGINE), prompts, params)
    tiny = dict(ENGINE, num_kv_blocks=12, max_model_len=128)  # 11 usable blocks of 16 tokens: 176 tokens
    llm = LLM(folder, async_scheduling=True, **tiny)
    assert _generate(llm, prompts, params) == reference
    assert llm.llm_engine.engine_core.make_stats().num_preemptions > 0
    _assert_all_blocks_free(llm)


def test_placeholder_position_gets_the_workers_last_sampled_token(folder: str, monkeypatch) -> None:
    """The invariant async scheduling rests on: the worker feeds a decode step (scheduled before the
    previous output came back) the token it sampled itself in the step before."""
    llm = LLM(folder, async_scheduling=True, **ENGINE)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    last_sampled: dict[str, int] = {}
    checked = []
    prepare_inputs, execute_model = runner._prepare_inputs, runner.execute_model

    def checking_prepare_inputs(scheduler_output):
        step = prepare_inputs(scheduler_output)
        input_ids = step.input_ids.tolist()
        for index, request_id in enumerate(step.request_ids):
            if step.num_scheduled[index] == 1 and request_id in last_sampled:
                token_id = input_ids[int(step.query_start_loc[index])]
                checked.append((request_id, token_id, last_sampled[request_id]))
        return step

    greedy_decode = runner.greedy_decode
    assert greedy_decode is not None  # float32 plain_native: greedy decode steps read the batch natively

    def checking_greedy_decode(rows, allowed=None):
        # The native step's input for each row: the batch's token at the row's computed position.
        batch = runner.input_batch
        request_of_row = {state.row: request_id for request_id, state in batch.requests.items()}
        for row in rows:
            request_id = request_of_row[row]
            if request_id in last_sampled:
                token_id = int(batch.token_ids[row, batch.num_computed_tokens[row]])
                checked.append((request_id, token_id, last_sampled[request_id]))
        return greedy_decode(rows, allowed)

    def recording_execute_model(scheduler_output):
        output = execute_model(scheduler_output)
        for request_id, token_ids in zip(output.request_ids, output.sampled_token_ids):
            if token_ids:
                last_sampled[request_id] = token_ids[-1]
        return output

    core = llm.llm_engine.engine_core
    submit = core.executor.execute_model_async
    submitted_behind_another = []

    def counting_submit(scheduler_output):
        submitted_behind_another.append(len(core.batch_queue) > 0)
        return submit(scheduler_output)

    monkeypatch.setattr(runner, "_prepare_inputs", checking_prepare_inputs)
    monkeypatch.setattr(runner, "greedy_decode", checking_greedy_decode)
    monkeypatch.setattr(runner, "execute_model", recording_execute_model)
    monkeypatch.setattr(core.executor, "execute_model_async", counting_submit)
    _generate(llm, _prompts(4, seed=4), SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    # Every step but the first was scheduled while the one before it was still in flight.
    assert len(submitted_behind_another) >= 32 and all(submitted_behind_another[1:])
    assert len(checked) >= 4 * 30
    assert all(fed == sampled for _, fed, sampled in checked)


def test_abort_mid_flight_frees_every_block(folder: str) -> None:
    prompts = _prompts(6, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=34, ignore_eos=True)
    reference = _generate(LLM(folder, **ENGINE), prompts, params)
    llm = LLM(folder, async_scheduling=True, **ENGINE)
    engine = llm.llm_engine
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
    finished = {}
    aborted = False
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        if not aborted and len(engine.engine_core.batch_queue) == 1 and "1" not in finished:
            # One step is in flight (and contains "1" and "4" as decodes): abort them now.
            in_flight = next(iter(engine.engine_core.batch_queue)).scheduler_output.num_scheduled_tokens
            if {"1", "4"} <= in_flight.keys():
                engine.abort_request(["1", "4"])
                aborted = True
    assert aborted
    assert "1" not in finished and "4" not in finished
    assert {rid: list(tokens) for rid, tokens in finished.items()} == {
        str(i): reference[i][0] for i in (0, 2, 3, 5)}
    _assert_all_blocks_free(llm)


def test_injected_step_failure_fails_only_that_batch(folder: str, monkeypatch) -> None:
    prompts = _prompts(6, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    reference = _generate(LLM(folder, **ENGINE), prompts, params)
    # Two seats: later requests are admitted after the failure, so they must come out right.
    llm = LLM(folder, async_scheduling=True, **dict(ENGINE, max_num_seqs=2))
    worker = llm.llm_engine.engine_core.executor.worker
    runner = worker.model_runner
    current = {}
    calls = {"forward": 0}
    execute_model, forward = worker.execute_model, runner.forward

    def recording_execute_model(scheduler_output):
        current["batch"] = set(scheduler_output.num_scheduled_tokens)
        return execute_model(scheduler_output)

    def failing_once(model_step):
        # The fifth model step fails, whichever path runs it (the forward, or greedy decode from the batch).
        def step(*args, **kwargs):
            calls["forward"] += 1
            if calls["forward"] == 5:
                current["failed"] = current["batch"]
                raise RuntimeError("injected step failure")
            return model_step(*args, **kwargs)
        return step

    monkeypatch.setattr(worker, "execute_model", recording_execute_model)
    monkeypatch.setattr(runner, "forward", failing_once(forward))
    monkeypatch.setattr(runner, "greedy_decode", failing_once(runner.greedy_decode))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    failed_ids = {str(int(rid)) for rid in current["failed"]}
    errors = {o.request_id for o in outputs if o.outputs[0].finish_reason == "error"}
    request_ids = [o.request_id for o in outputs]
    assert errors and errors == {request_ids[int(rid)] for rid in failed_ids}
    for index, output in enumerate(outputs):
        if output.request_id not in errors:
            assert list(output.outputs[0].token_ids) == reference[index][0]
    _assert_all_blocks_free(llm)
    # The engine keeps serving.
    assert _generate(llm, prompts[:2], params) == reference[:2]
    _assert_all_blocks_free(llm)


def test_multiprocess_tp2_async_equal(folder: str) -> None:
    prompts = _prompts(5, seed=7)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (32, 3, 40, 33, 1)]
    reference = _generate(LLM(folder, **ENGINE), prompts, params)
    llm = LLM(folder, async_scheduling=True, tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE)
    try:
        assert llm.llm_engine.engine_core.executor.max_concurrent_batches == 2
        assert _generate(llm, prompts, params) == reference
        _assert_all_blocks_free(llm)
    finally:
        llm.llm_engine.shutdown()
