"""PullConnector: a prefill engine (P, producer) and a decode engine (D, consumer) give the greedy tokens of one
engine; D computes only each prompt's last token; faults recompute or fail per kv_load_failure_policy; every
block ends free on both sides.

P runs in its own process (prefill_engine_process.py) where the test needs a process (it is killed); elsewhere an
in-process P is enough (its block server is a thread) and lets the test reach its cache.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import zmq

from generation_helpers import random_prompts
from pagedserve import LLM, SamplingParams
from pagedserve.core.request import RequestStatus
from pagedserve.engine.dp_engine_core import DataParallelEngineCore

ENGINE_KWARGS: dict[str, Any] = dict(max_model_len=256, num_kv_blocks=48, block_size=16, native_decode_stack=False,
                                     num_cpu_threads=1)
NUM_DECODE_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_DECODE_TOKENS, ignore_eos=True)
DRIVER = os.path.join(os.path.dirname(__file__), "prefill_engine_process.py")


def producer_config(**extra: Any) -> dict[str, Any]:
    return {"kv_connector": "PullConnector", "kv_role": "kv_producer", "kv_connector_extra_config": extra}


def consumer_config(policy: str = "recompute", **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "PullConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": policy,
            "kv_connector_extra_config": extra}


class PrefillProcess:
    """P in a subprocess, driven over its stdin / stdout (see prefill_engine_process.py)."""

    def __init__(self, model_dir: str, **engine_kwargs: Any) -> None:
        self.process = subprocess.Popen([sys.executable, DRIVER, model_dir, json.dumps(engine_kwargs)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ)
        ready = self._read()
        assert ready.get("ready"), ready
        self.port = int(ready.get("port") or 0)  # P's block server
        # Every DP rank's engine id and ports ([{"engine_id", "ports"}]; one entry with data_parallel_size 1).
        self.data_parallel_ranks: list[dict[str, Any]] = ready.get("data_parallel_ranks") or []

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the prefill process exited with {self.process.wait()}")
        return json.loads(line)

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._read()

    def prefill(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        return [output["kv_transfer_params"] for output in self.ask(op="prefill", prompts=prompts)["outputs"]]

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.ask(op="quit")
            except (RuntimeError, BrokenPipeError):
                pass
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def remote_params(kv_transfer_params: dict[str, Any]) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NUM_DECODE_TOKENS, ignore_eos=True,
                          extra_args={"kv_transfer_params": kv_transfer_params})


def token_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [output.outputs[0].token_ids
            for output in llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)]


def record_scheduled_tokens(llm: LLM) -> dict[str, list[int]]:
    """Per request id, the tokens each step scheduled for it on this engine (a spy on the worker's steps)."""
    worker = llm.llm_engine.engine_core.executor.worker
    seen: dict[str, list[int]] = {}
    execute = worker.execute_model

    def spy(scheduler_output):  # type: ignore[no-untyped-def]
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            seen.setdefault(request_id, []).append(num_tokens)
        return execute(scheduler_output)

    worker.execute_model = spy
    return seen


def cores(llm: LLM) -> list[Any]:
    """The engine's EngineCores, one per DP rank."""
    core = llm.llm_engine.engine_core
    return list(core.cores) if isinstance(core, DataParallelEngineCore) else [core]


def assert_all_blocks_free(llm: LLM, timeout_s: float = 10.0) -> None:
    """Steps the engine until no DP rank holds a block for the connector, then checks every rank's blocks are
    free."""
    engine = llm.llm_engine
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.01)
    assert not engine.has_unfinished_requests()
    for rank, core in enumerate(cores(llm)):
        assert core.kv_cache_manager.num_free_blocks == core.runtime_info.num_kv_blocks - 1, f"DP rank {rank}"


def assert_producer_blocks_free(producer: PrefillProcess) -> None:
    """P (a subprocess) holds no block for D any more and every block of its cache is free."""
    blocks = producer.ask(op="blocks", wait_s=30)
    assert blocks["num_held"] == 0
    assert blocks["num_free_blocks"] == blocks["num_blocks"] - 1


# MLA pages through P -> D also run in test_pd_int8_kv_pages[deepseek-v3] and the mooncake transport's test.
@pytest.fixture(scope="module", params=["llama", pytest.param("deepseek-v3", marks=pytest.mark.slow)])
def model_dir(request: pytest.FixtureRequest, tiny_model_dir) -> str:  # type: ignore[no-untyped-def]
    return tiny_model_dir(request.param)


def test_pd_greedy_equals_one_engine(model_dir: str) -> None:
    """Chunked prefill on P (16-token budget), a prefix hit on P (a prompt sent twice) and on D (D computed a
    prefix of a prompt before): D's greedy tokens equal one engine's and D computes only the last prompt token."""
    prompts = random_prompts(3, 45, 70, seed=5)
    shared = prompts[0][:40]  # D computes this prefix itself first: its two full blocks are a local hit
    reference_engine = LLM(model_dir, **ENGINE_KWARGS)
    expected = token_ids(reference_engine, prompts, GREEDY)
    reference_engine.llm_engine.shutdown()

    # The first request of prompts[1] is never pulled (D pulls its prefix-hit twin): P frees it after 8 s (long
    # enough for a loaded machine to finish the pulls first).
    producer = PrefillProcess(model_dir, kv_transfer_config=producer_config(free_timeout_s=8),
                              max_num_batched_tokens=16,
                              **ENGINE_KWARGS)
    consumer = LLM(model_dir, kv_transfer_config=consumer_config(policy="fail"), **ENGINE_KWARGS)
    try:
        first = producer.prefill(prompts)
        again = producer.prefill([prompts[1]])  # a prefix-cache hit on P: its blocks are the first request's
        assert again[0]["remote_block_ids"][:2] == first[1]["remote_block_ids"][:2]
        token_ids(consumer, [shared], SamplingParams(temperature=0, max_tokens=1))
        scheduled = record_scheduled_tokens(consumer)
        outputs = consumer.generate([{"prompt_token_ids": prompt} for prompt in prompts],
                                    [remote_params(params) for params in (first[0], again[0], first[2])],
                                    use_tqdm=False)
        assert [output.outputs[0].token_ids for output in outputs] == expected
        assert all(output.outputs[0].finish_reason == "length" for output in outputs)
        # The prompt came from P: D's first step of each request computed one token (the last prompt token).
        assert sorted(steps[0] for steps in scheduled.values()) == [1, 1, 1]
        assert sum(sum(steps) for steps in scheduled.values()) == 3 * NUM_DECODE_TOKENS
        assert outputs[0].num_cached_tokens == 32  # the local hit on D
        assert_all_blocks_free(consumer)
        assert_producer_blocks_free(producer)
    finally:
        producer.close()
        consumer.llm_engine.shutdown()


def test_consumer_uses_the_producers_bytes(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """Negative control: with P's KV zeroed after its prefill, D's tokens change (D read P's pages, nothing
    else); MultiConnector around the same PullConnector gives the plain connector's tokens."""
    model = tiny_model_dir("llama")
    prompts = random_prompts(2, 30, 50, seed=9)
    producer = LLM(model, kv_transfer_config=producer_config(), **ENGINE_KWARGS)
    consumer = LLM(model, kv_transfer_config={
        "kv_connector": "MultiConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"connectors": [consumer_config(policy="fail")]}}, **ENGINE_KWARGS)
    reference_engine = LLM(model, **ENGINE_KWARGS)
    try:
        expected = token_ids(reference_engine, prompts, GREEDY)
        params = [output.kv_transfer_params for output in producer.generate(
            [{"prompt_token_ids": prompt} for prompt in prompts],
            SamplingParams(temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}),
            use_tqdm=False)]
        assert token_ids(consumer, prompts[:1], [remote_params(params[0])]) == expected[:1]
        for layer_regions in producer.llm_engine.engine_core.executor.worker.kv_connector.regions.regions:
            for region in layer_regions:
                region.zero_()
        assert token_ids(consumer, prompts[1:], [remote_params(params[1])]) != expected[1:]
        assert_all_blocks_free(producer)
        assert_all_blocks_free(consumer)
    finally:
        for llm in (producer, consumer, reference_engine):
            llm.llm_engine.shutdown()


def test_producer_killed_recompute_or_fail(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """P dies after its prefill: with 'recompute' D computes the prompt itself (same tokens), with 'fail' the
    request ends with finish_reason 'error'; D's blocks all end free and D keeps serving."""
    model = tiny_model_dir("llama")
    prompts = random_prompts(2, 20, 40, seed=11)
    reference_engine = LLM(model, **ENGINE_KWARGS)
    expected = token_ids(reference_engine, prompts, GREEDY)
    reference_engine.llm_engine.shutdown()
    producer = PrefillProcess(model, kv_transfer_config=producer_config(), **ENGINE_KWARGS)
    recomputing = LLM(model, kv_transfer_config=consumer_config("recompute", transfer_timeout_s=1), **ENGINE_KWARGS)
    failing = LLM(model, kv_transfer_config=consumer_config("fail", transfer_timeout_s=1), **ENGINE_KWARGS)
    try:
        params = producer.prefill(prompts)
        producer.kill()
        assert token_ids(recomputing, prompts[:1], [remote_params(params[0])]) == expected[:1]
        failed = failing.generate([{"prompt_token_ids": prompts[1]}], [remote_params(params[1])], use_tqdm=False)[0]
        assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].token_ids == []
        for llm in (recomputing, failing):
            assert_all_blocks_free(llm)
        assert token_ids(failing, prompts[1:], GREEDY) == expected[1:]
    finally:
        producer.close()
        recomputing.llm_engine.shutdown()
        failing.llm_engine.shutdown()


def test_silent_producer_timeout_and_abort_during_transfer(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """A producer that never answers: the load times out and the request fails ('fail'); a request aborted
    while its load waits keeps its blocks until the loader gives up, then every block is free."""
    model = tiny_model_dir("llama")
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    consumer = LLM(model, kv_transfer_config=consumer_config("fail", transfer_timeout_s=1), **ENGINE_KWARGS)
    engine = consumer.llm_engine
    scheduler = engine.engine_core.scheduler
    prompt = random_prompts(1, 40, 41, seed=3)[0]
    params = {"do_remote_prefill": True, "remote_engine_id": "silent", "remote_host": "127.0.0.1",
              "remote_port": port, "remote_block_ids": [1, 2, 3], "remote_request_id": "r"}
    try:
        start = time.monotonic()
        failed = consumer.generate([{"prompt_token_ids": prompt}], [remote_params(params)], use_tqdm=False)[0]
        assert failed.outputs[0].finish_reason == "error"
        assert time.monotonic() - start >= 1.0
        assert_all_blocks_free(consumer)

        engine.add_request("aborted", {"prompt_token_ids": prompt}, remote_params(params))
        engine.step()
        request = scheduler.remote_kv_requests["aborted"]
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert engine.engine_core.kv_cache_manager.get_block_ids("aborted")
        engine.abort_request(["aborted"])
        engine.step()
        assert "aborted" in scheduler.kv_held_requests  # the loader may still write: the blocks stay reserved
        assert_all_blocks_free(consumer)
    finally:
        consumer.llm_engine.shutdown()
        silent.close()
        context.term()


def test_producer_frees_blocks_after_timeout(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """No consumer asks: P frees the request's blocks free_timeout_s after it finished."""
    producer = LLM(tiny_model_dir("llama"), kv_transfer_config=producer_config(free_timeout_s=0.3), **ENGINE_KWARGS)
    core = producer.llm_engine.engine_core
    try:
        output = producer.generate([{"prompt_token_ids": list(range(5, 45))}], SamplingParams(
            temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}),
            use_tqdm=False)[0]
        assert len(output.kv_transfer_params["remote_block_ids"]) == 3
        assert core.scheduler.has_kv_held_requests()
        assert core.kv_cache_manager.num_free_blocks == core.runtime_info.num_kv_blocks - 1 - 3
        start = time.monotonic()
        assert_all_blocks_free(producer)
        assert time.monotonic() - start >= 0.25
    finally:
        producer.llm_engine.shutdown()


@pytest.mark.parametrize("consumer_model, consumer_kwargs, message", [
    ({}, dict(block_size=32), "block_size: producer 16, consumer 32"),
    ({}, dict(block_size=8), "block_size: producer 16, consumer 8"),
    ({}, dict(dtype="bfloat16"), "dtype: producer torch.float32, consumer torch.bfloat16"),
    (dict(num_hidden_layers=3), {}, "consumer LlamaForCausalLM layers=3"),
])
def test_handshake_mismatch_names_both_sides(tiny_model_dir, caplog, consumer_model, consumer_kwargs,  # type: ignore[no-untyped-def]
                                             message) -> None:
    model = tiny_model_dir("llama")
    producer = LLM(model, kv_transfer_config=producer_config(), **ENGINE_KWARGS)
    consumer = LLM(tiny_model_dir("llama", **consumer_model), kv_transfer_config=consumer_config("fail"),
                   **(ENGINE_KWARGS | consumer_kwargs))
    prompt = list(range(5, 45))
    try:
        params = producer.generate([{"prompt_token_ids": prompt}], SamplingParams(
            temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}),
            use_tqdm=False)[0].kv_transfer_params
        with caplog.at_level(logging.ERROR, logger="pagedserve.kv_transfer.pull_connector_worker"):
            failed = consumer.generate([{"prompt_token_ids": prompt}], [remote_params(params)], use_tqdm=False)[0]
        assert failed.outputs[0].finish_reason == "error"
        assert message in caplog.text
        assert_all_blocks_free(consumer)
    finally:
        producer.llm_engine.shutdown()
        consumer.llm_engine.shutdown()


@pytest.mark.parametrize("kind", ["llama", "deepseek-v3"])
def test_pd_int8_kv_pages(tiny_model_dir, kind) -> None:  # type: ignore[no-untyped-def]
    """int8 KV pages (int8 K/V or latent with their scales in the page): P -> D equals one engine with the same
    cache dtype, and D computes one prompt token per request."""
    model = tiny_model_dir(kind)
    int8_kwargs = ENGINE_KWARGS | dict(kv_cache_dtype="int8")
    prompts = random_prompts(2, 30, 50, seed=13)
    reference_engine = LLM(model, **int8_kwargs)
    producer = LLM(model, kv_transfer_config=producer_config(), **int8_kwargs)
    consumer = LLM(model, kv_transfer_config=consumer_config(policy="fail"), **int8_kwargs)
    try:
        expected = token_ids(reference_engine, prompts, GREEDY)
        params = [output.kv_transfer_params for output in producer.generate(
            [{"prompt_token_ids": prompt} for prompt in prompts],
            SamplingParams(temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}),
            use_tqdm=False)]
        scheduled = record_scheduled_tokens(consumer)
        assert token_ids(consumer, prompts, [remote_params(value) for value in params]) == expected
        assert sorted(steps[0] for steps in scheduled.values()) == [1, 1]
        assert_all_blocks_free(producer)
        assert_all_blocks_free(consumer)
    finally:
        for llm in (producer, consumer, reference_engine):
            llm.llm_engine.shutdown()


def test_producer_killed_while_a_read_is_in_flight(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """P answers one pull, is frozen (SIGSTOP), D sends the next read, P is killed before answering: the load
    times out, D recomputes (same tokens) and every D block ends free."""
    import signal

    model = tiny_model_dir("llama")
    prompts = random_prompts(2, 30, 45, seed=17)
    reference_engine = LLM(model, **ENGINE_KWARGS)
    expected = token_ids(reference_engine, prompts, GREEDY)
    reference_engine.llm_engine.shutdown()
    producer = PrefillProcess(model, kv_transfer_config=producer_config(), **ENGINE_KWARGS)
    consumer = LLM(model, kv_transfer_config=consumer_config("recompute", transfer_timeout_s=2), **ENGINE_KWARGS)
    engine = consumer.llm_engine
    connector = engine.engine_core.executor.worker.kv_connector
    try:
        params = producer.prefill(prompts)
        assert token_ids(consumer, prompts[:1], [remote_params(params[0])]) == expected[:1]
        num_loaded_bytes = connector.num_loaded_bytes
        assert num_loaded_bytes > 0
        producer.process.send_signal(signal.SIGSTOP)
        engine.add_request("second", {"prompt_token_ids": prompts[1]}, remote_params(params[1]))
        engine.step()  # parks the request and hands its load order to the loader thread
        assert "second" in engine.engine_core.scheduler.remote_kv_requests
        time.sleep(0.2)  # the loader has sent its read to the frozen producer
        producer.kill()
        outputs = []
        deadline = time.monotonic() + 30
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            outputs += [output for output in engine.step() if output.finished]
        (output,) = outputs
        assert output.outputs[0].token_ids == expected[1]
        assert connector.num_loaded_bytes == num_loaded_bytes  # nothing arrived for the second request
        assert_all_blocks_free(consumer)
    finally:
        producer.close()
        consumer.llm_engine.shutdown()
