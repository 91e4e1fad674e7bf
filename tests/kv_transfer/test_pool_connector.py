"""PoolConnector: engines sharing a KV pool (a redis-server or mooncake_master each test starts on a free port of
127.0.0.1 and stops). A second engine serving a prompt whose prefix the first computed loads the prefix from the
pool and computes only the rest, with the same greedy tokens; a pool that is down at start or goes down mid-run
leaves the engine serving (said once); a corrupted or truncated block is detected and recomputed; MultiConnector
composes PullConnector (PD) with the pool.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest

from generation_helpers import random_prompts
from pagedserve import LLM, SamplingParams
from pagedserve.kv_transfer.pool_block_format import HEADER, PoolBlockError, block_key, decode_block
from pagedserve.server.metrics import ServerMetrics
from pool_store_servers import StoreServer, free_port

ENGINE_KWARGS: dict[str, Any] = dict(max_model_len=256, num_kv_blocks=48, block_size=16, native_decode_stack=False,
                                     num_cpu_threads=1)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
POOL_LOGGER = "pagedserve.kv_transfer.pool_store_connection"


def pool_config(server_url: str, backend: str = "redis", **extra: Any) -> dict[str, Any]:
    extra = {"backend": backend, "url": server_url, **extra}
    if backend == "mooncake":
        extra.setdefault("mooncake_segment_bytes", 64 * 2**20)
    return {"kv_connector": "PoolConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [output.outputs[0].token_ids
            for output in llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)]


def record_first_steps(llm: LLM) -> dict[str, int]:
    """Per request id, the tokens the first step that computed anything scheduled for it (a spy on the worker)."""
    worker = llm.llm_engine.engine_core.executor.worker
    first: dict[str, int] = {}
    execute = worker.execute_model

    def spy(scheduler_output):  # type: ignore[no-untyped-def]
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            first.setdefault(request_id, num_tokens)
        return execute(scheduler_output)

    worker.execute_model = spy
    return first


def pool_worker(llm: LLM) -> Any:
    connector = llm.llm_engine.engine_core.executor.worker.kv_connector
    return connector.parts[-1] if hasattr(connector, "parts") else connector


def flush(llm: LLM) -> Any:
    worker = pool_worker(llm)
    assert worker.wait_for_stores(30.0)
    return worker


def metric(llm: LLM, name: str) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == name)


@pytest.fixture
def redis_server() -> Iterator[StoreServer]:
    server = StoreServer("redis").start()
    yield server
    server.stop()


@pytest.mark.parametrize("backend", ["redis", "mooncake"])
def test_second_engine_computes_only_the_suffix(tiny_model_dir, backend: str) -> None:  # type: ignore[no-untyped-def]
    """Engine A computes prefix + suffix A; engine B, fresh, serves prefix + suffix B: it loads the 4 prefix blocks
    from the pool, computes only the rest, and its tokens equal those A gives for the same prompt; the external
    prefix cache counters (LLM.get_metrics and the server's /metrics) count the hit."""
    server = StoreServer(backend).start()
    model = tiny_model_dir("llama")
    prefix, suffix_a, suffix_b = random_prompts(3, 20, 30, seed=21)
    prefix = (prefix * 4)[:64]
    engine_a = engine_b = None
    try:
        engine_a = LLM(model, kv_transfer_config=pool_config(server.url, backend), **ENGINE_KWARGS)
        generate(engine_a, [prefix + suffix_a])
        assert flush(engine_a).num_stored_blocks >= 4
        engine_b = LLM(model, kv_transfer_config=pool_config(server.url, backend), **ENGINE_KWARGS)
        first_steps = record_first_steps(engine_b)
        (tokens_b,) = generate(engine_b, [prefix + suffix_b])
        assert list(first_steps.values()) == [len(suffix_b)]  # the prefix came from the pool
        assert pool_worker(engine_b).num_loaded_blocks == 4
        assert metric(engine_b, "vllm:external_prefix_cache_hits") == 64
        assert metric(engine_b, "vllm:external_prefix_cache_queries") == 64 + len(suffix_b)
        assert metric(engine_b, "vllm:prefix_cache_hits") == 0
        assert generate(engine_a, [prefix + suffix_b]) == [tokens_b]  # A: a local prefix hit, computed by A
        server_metrics = ServerMetrics("tiny")
        server_metrics.record_scheduler_stats(engine_b.llm_engine.engine_core.make_stats())
        assert b'vllm:external_prefix_cache_hits_total{model_name="tiny"} 64.0' in server_metrics.render()
    finally:
        for engine in (engine_a, engine_b):
            if engine is not None:
                engine.llm_engine.shutdown()
        server.stop()


def test_pool_down_at_start_and_mid_run(tiny_model_dir, caplog) -> None:  # type: ignore[no-untyped-def]
    """The pool is down when the engine starts (it serves, and says so once), comes up (blocks are stored again
    after retry_interval_s), then goes down mid-run (it serves on, and says so once more); the tokens never
    change."""
    server = StoreServer("redis", port=free_port())  # not started yet
    model = tiny_model_dir("llama")
    prompts = random_prompts(4, 40, 60, seed=23)
    reference_engine = LLM(model, **ENGINE_KWARGS)
    expected = generate(reference_engine, prompts)
    reference_engine.llm_engine.shutdown()
    caplog.set_level(logging.WARNING, logger=POOL_LOGGER)
    engine = LLM(model, kv_transfer_config=pool_config(server.url, retry_interval_s=0.3, lookup_timeout_s=0.2,
                                                       transfer_timeout_s=0.5), **ENGINE_KWARGS)
    try:
        assert generate(engine, prompts[:2]) == expected[:2]
        assert generate(engine, prompts[:1]) == expected[:1]
        down = [record for record in caplog.records if "unavailable" in record.getMessage()]
        assert len(down) == 1, caplog.text
        server.start()
        for attempt in range(20):  # the first step after retry_interval_s connects again; new prompts store blocks
            time.sleep(0.35)
            fresh = random_prompts(1, 40, 60, seed=100 + attempt)
            generate(engine, fresh)
            if flush(engine).num_stored_blocks:
                break
        assert flush(engine).num_stored_blocks > 0
        server.stop()
        caplog.clear()
        assert generate(engine, prompts) == expected
        assert generate(engine, prompts[3:]) == expected[3:]
        down = [record for record in caplog.records if "unavailable" in record.getMessage()]
        assert len(down) == 1, caplog.text
    finally:
        engine.llm_engine.shutdown()
        server.stop()


def test_corrupted_or_truncated_block_is_recomputed(tiny_model_dir, redis_server: StoreServer) -> None:  # type: ignore[no-untyped-def]
    """A pool block with a flipped payload byte (checksum) and one cut short (length) are detected by the engine
    that reads them: it loads the good blocks before them, recomputes from them on, gives the tokens of an engine
    without the pool, and stores good values over the bad ones."""
    import redis

    model = tiny_model_dir("llama")
    prompts = [prompt[:70] for prompt in random_prompts(2, 70, 80, seed=25)]
    engine_a = LLM(model, kv_transfer_config=pool_config(redis_server.url), **ENGINE_KWARGS)
    engine_b = None
    client = redis.Redis.from_url(redis_server.url)
    try:
        expected = generate(engine_a, prompts)
        worker_a = flush(engine_a)
        keys = [[block_key(worker_a.fingerprint, block_hash) for block_hash in request_hashes]
                for request_hashes in _prompt_block_hashes(prompts, 16)]
        corrupted, truncated = keys[0][1], keys[1][2]
        value = bytearray(client.get(corrupted))
        value[HEADER.size + 5] ^= 0xFF
        client.set(corrupted, bytes(value))
        client.set(truncated, client.get(truncated)[:-100])

        engine_b = LLM(model, kv_transfer_config=pool_config(redis_server.url), **ENGINE_KWARGS)
        first_steps = record_first_steps(engine_b)
        assert generate(engine_b, prompts) == expected
        worker_b = flush(engine_b)
        assert worker_b.num_bad_blocks == 2 and worker_b.num_loaded_blocks == 1 + 2
        assert sorted(first_steps.values()) == sorted([70 - 16, 70 - 32])
        for key, block_hash in ((corrupted, _prompt_block_hashes(prompts, 16)[0][1]),
                                (truncated, _prompt_block_hashes(prompts, 16)[1][2])):
            decode_block(client.get(key), block_hash, worker_b.block_bytes)  # stored again, good
        with pytest.raises(PoolBlockError, match="checksum"):
            decode_block(bytes(value), _prompt_block_hashes(prompts, 16)[0][1], worker_b.block_bytes)
    finally:
        client.close()
        for engine in (engine_a, engine_b):
            if engine is not None:
                engine.llm_engine.shutdown()


def _prompt_block_hashes(prompts: list[list[int]], block_size: int) -> list[list[int]]:
    from pagedserve.core.block_hash import update_request_block_hashes
    from pagedserve.core.request import Request

    hashes = []
    for index, prompt in enumerate(prompts):
        request = Request(request_id=str(index), prompt_token_ids=prompt, sampling_params=SamplingParams())
        hashes.append(list(update_request_block_hashes(request, block_size)))
    return hashes


def test_multi_connector_pull_and_pool(tiny_model_dir, redis_server: StoreServer) -> None:  # type: ignore[no-untyped-def]
    """P and D each run MultiConnector(PullConnector, PoolConnector): a request sent with P's kv_transfer_params
    pulls its prompt from P; a request without them whose prompt P computed loads its full blocks from the pool;
    both give one engine's tokens."""
    model = tiny_model_dir("llama")
    pulled, pooled = random_prompts(2, 40, 60, seed=27)
    num_pooled_blocks = (len(pooled) - 1) // 16
    pool_part = pool_config(redis_server.url)
    producer = LLM(model, kv_transfer_config={
        "kv_connector": "MultiConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [{"kv_connector": "PullConnector", "kv_role": "kv_producer"},
                                                     pool_part]}}, **ENGINE_KWARGS)
    consumer = None
    try:
        expected = generate(producer, [pulled, pooled])
        (params,) = [output.kv_transfer_params for output in producer.generate(
            [{"prompt_token_ids": pulled}], SamplingParams(temperature=0, max_tokens=1, extra_args={
                "kv_transfer_params": {"do_remote_decode": True}}), use_tqdm=False)]
        flush(producer)
        consumer = LLM(model, kv_transfer_config={
            "kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [
                {"kv_connector": "PullConnector", "kv_role": "kv_consumer"}, pool_part]}}, **ENGINE_KWARGS)
        first_steps = record_first_steps(consumer)
        outputs = consumer.generate(
            [{"prompt_token_ids": pulled}, {"prompt_token_ids": pooled}],
            [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                            extra_args={"kv_transfer_params": params}), GREEDY], use_tqdm=False)
        assert [output.outputs[0].token_ids for output in outputs] == expected
        assert sorted(first_steps.values()) == sorted([1, len(pooled) - 16 * num_pooled_blocks])
        assert pool_worker(consumer).num_loaded_blocks == num_pooled_blocks
    finally:
        for engine in (producer, consumer):
            if engine is not None:
                engine.llm_engine.shutdown()
