"""The KV pool's local tier (backend "local": host memory, then a disk folder): the least recently used values
move from memory to disk and leave the disk last used first; a restarted tier serves the folder's files; and an
engine whose device cache evicted a prefix loads it back from the tier instead of recomputing it, with the tokens
of an engine without the tier."""
from __future__ import annotations

import os
from typing import Any

from generation_helpers import random_prompts
from pagedserve import LLM, SamplingParams
from pagedserve.kv_transfer.local_pool_store import LocalTier


def test_memory_then_disk_least_recently_used_first(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tier = LocalTier(str(tmp_path), memory_bytes=250, disk_bytes=250)
    for name in "abcde":  # memory holds two values, the disk two: a, b, c spill in turn, and c's spill evicts a
        tier.put(f"kv/{name}", name.encode() * 100)
    assert tier.get("kv/a") is None
    assert tier.get("kv/b") == b"b" * 100 and tier.get("kv/e") == b"e" * 100
    assert tier.exists(["kv/a", "kv/b", "kv/c", "kv/d", "kv/e"]) == [False, True, True, True, True]
    assert sorted(os.listdir(tmp_path)) == ["kv~b", "kv~c"]
    restarted = LocalTier(str(tmp_path), memory_bytes=250, disk_bytes=250)
    assert restarted.get("kv/c") == b"c" * 100
    restarted.remove("kv/c")
    assert restarted.exists(["kv/c"]) == [False] and sorted(os.listdir(tmp_path)) == ["kv~b"]


def test_device_evicted_prefix_comes_back_from_the_tier(tiny_model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A 20-block device cache: after prompt A, four other prompts evict A's blocks; A again loads them from the
    tier (every value went through the disk: 1 byte of memory) and computes only its last partial block."""
    model = tiny_model_dir("llama")
    engine_kwargs: dict[str, Any] = dict(max_model_len=128, num_kv_blocks=20, block_size=16,
                                         native_decode_stack=False, num_cpu_threads=1)
    prompts = random_prompts(5, 70, 75, seed=31)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    reference_engine = LLM(model, **engine_kwargs)
    expected = [output.outputs[0].token_ids for output in reference_engine.generate(
        [{"prompt_token_ids": prompt} for prompt in prompts[:1]], greedy, use_tqdm=False)]
    reference_engine.llm_engine.shutdown()
    engine = LLM(model, kv_transfer_config={
        "kv_connector": "PoolConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
            "backend": "local", "url": f"local://{tmp_path}", "local_memory_bytes": 1}}, **engine_kwargs)
    try:
        for prompt in prompts:
            engine.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
        worker = engine.llm_engine.engine_core.executor.worker.kv_connector
        assert worker.wait_for_stores(30.0) and os.listdir(tmp_path)
        stats_before = engine.llm_engine.engine_core.make_stats()
        (again,) = engine.generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)
        stats = engine.llm_engine.engine_core.make_stats()
        assert again.outputs[0].token_ids == expected[0]
        assert stats.prefix_cache_hits == stats_before.prefix_cache_hits  # the device cache had lost it all
        num_blocks = (len(prompts[0]) - 1) // 16
        assert stats.external_prefix_cache_hits - stats_before.external_prefix_cache_hits == 16 * num_blocks
        assert worker.num_loaded_blocks == num_blocks
    finally:
        engine.llm_engine.shutdown()
