"""Sparse KV offload (sparse_kv_offload=...) on the tiny DeepSeek-V3.2 and GLM-5 checkpoints: float32 greedy
tokens identical with offload on and off over 32 steps, with resident buffers smaller than the blocks one step's
top-k spans (block_size 4, index_topk 8, 3 resident blocks: forced misses and multi-round gathers); with prefix
caching, chunked prefill and preemption; both tiers empty after finish, abort and preemption; the tier mapped from
an unlinked file (no name left in the directory at any time); the knob refused for a model without an indexer and with an int8 cache."""
from __future__ import annotations

import os
import random

import pytest
from logprobs_check import check_outputs_equal
from process_mappings import mapped_file_paths
from tiny_models import DSA_KINDS

from pagedserve import LLM, SamplingParams
from pagedserve.sparse_kv_offload.offload_tier import TIER_FILE_PREFIX

NUM_NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
BLOCK_SIZE = 4
# Below the up-to-8 blocks one decode's 8 selected positions span: decodes miss and gather in rounds.
NUM_RESIDENT_BLOCKS = 3


def _prompts() -> list[list[int]]:
    """One 5-token prompt and three sharing a 35-token prefix (38, 46 and 55 tokens)."""
    rng = random.Random(0)
    shared = [rng.randrange(8, 600) for _ in range(35)]
    return [[rng.randrange(8, 600) for _ in range(5)]] + [shared + [rng.randrange(8, 600) for _ in range(n)]
                                                          for n in (3, 11, 20)]


PROMPTS = _prompts()


# The resident-cache engine's tokens per checkpoint folder (the plain path equals transformers with chunked prefill,
# prefix caching and preemption: test_deepseek_sparse_attention.py), computed once per session.
_RESIDENT_TOKENS: dict[str, list[list[int]]] = {}


def _resident_tokens(folder: str) -> list[list[int]]:
    if folder not in _RESIDENT_TOKENS:
        _RESIDENT_TOKENS[folder] = _generate(_engine(folder))
    return _RESIDENT_TOKENS[folder]


def _engine(folder: str, **kwargs) -> LLM:
    kwargs = {"max_model_len": 128, "num_kv_blocks": 128, "block_size": BLOCK_SIZE, "enable_prefix_caching": False,
              **kwargs}
    return LLM(folder, dtype="float32", **kwargs)


def _offload(directory: str) -> dict:
    return {"num_resident_blocks": NUM_RESIDENT_BLOCKS, "tier_directory": directory}


def _generate(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _tier_files(directory: str) -> list[str]:
    return [name for name in os.listdir(directory) if name.startswith(TIER_FILE_PREFIX)]


def _mapped_tier_files(directory: str) -> list[str]:
    return mapped_file_paths(os.path.join(directory, TIER_FILE_PREFIX))


def _assert_tiers_empty(llm: LLM) -> None:
    """No block held in the block pool (the tier is addressed by its ids) and no resident buffer left."""
    stats = llm.llm_engine.engine_core.make_stats()
    assert stats.kv_cache_usage == 0.0
    assert stats.sparse_kv_offload.num_resident_blocks == 0
    assert stats.sparse_kv_offload.num_resident_buffers == 0


@pytest.mark.parametrize("kind", DSA_KINDS)
def test_offload_equals_resident_cache_with_forced_misses(tiny_model_dir, tmp_path, kind: str) -> None:
    folder = tiny_model_dir(kind)
    expected = _resident_tokens(folder)
    llm = _engine(folder, sparse_kv_offload=_offload(str(tmp_path)))
    assert _tier_files(str(tmp_path)) == [] and len(_mapped_tier_files(str(tmp_path))) == 1
    check_outputs_equal(expected, _generate(llm), name_0="resident", name_1="offloaded")
    stats = llm.llm_engine.engine_core.make_stats().sparse_kv_offload
    assert stats.num_block_misses > 0 and stats.num_block_hits > 0
    assert stats.num_blocks_moved_in == stats.num_block_misses
    assert stats.num_blocks_evicted > 0 and stats.num_multi_round_gathers > 0
    num_layers = 3 if kind == "glm-moe-dsa" else 2
    num_tokens = sum(len(p) + NUM_NEW_TOKENS - 1 for p in PROMPTS)
    assert stats.num_tokens_moved_out == num_layers * num_tokens
    _assert_tiers_empty(llm)
    llm.llm_engine.shutdown()
    assert _tier_files(str(tmp_path)) == []


def test_offload_with_prefix_caching_and_chunked_prefill(tiny_model_dir, tmp_path) -> None:
    folder = tiny_model_dir("deepseek-v32")
    options = dict(enable_prefix_caching=True, max_num_batched_tokens=16)
    expected = _resident_tokens(folder)
    llm = _engine(folder, sparse_kv_offload=_offload(str(tmp_path)), **options)
    check_outputs_equal(expected, _generate(llm))
    hits_before = llm.llm_engine.engine_core.make_stats().prefix_cache_hits
    # The second pass reads cached blocks' latents from the tier and their index keys from the resident cache.
    check_outputs_equal(expected, _generate(llm))
    assert llm.llm_engine.engine_core.make_stats().prefix_cache_hits - hits_before >= 3 * 32
    _assert_tiers_empty(llm)
    llm.llm_engine.shutdown()


def test_offload_with_preemption_frees_the_preempted_buffers(tiny_model_dir, tmp_path) -> None:
    folder = tiny_model_dir("deepseek-v32")
    # The four requests need up to 66 blocks of 4 together; 40 force preemption by recompute.
    options = dict(num_kv_blocks=40)
    expected = _resident_tokens(folder)
    llm = _engine(folder, sparse_kv_offload=_offload(str(tmp_path)), **options)
    engine = llm.llm_engine
    core = engine.engine_core
    offload = core.executor.worker.kv_offload
    for prompt in PROMPTS:
        engine.add_request(engine.next_request_id(), {"prompt_token_ids": prompt}, GREEDY)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] = list(output.outputs[0].token_ids)
        # A preempted request keeps no resident buffer; a finished one at most until the next step tells the worker.
        allowed = {request.request_id for request in core.scheduler.running} | core.scheduler.finished_request_ids
        for buffers in offload.layer_buffers:
            assert set(buffers.buffers) <= allowed
    assert core.make_stats().num_preemptions > 0
    check_outputs_equal(expected, [tokens[key] for key in sorted(tokens, key=int)])
    _assert_tiers_empty(llm)
    engine.shutdown()


def test_offload_with_async_scheduling(tiny_model_dir, tmp_path) -> None:
    folder = tiny_model_dir("deepseek-v32")
    llm = _engine(folder, sparse_kv_offload=_offload(str(tmp_path)), async_scheduling=True)
    check_outputs_equal(_resident_tokens(folder), _generate(llm))
    _assert_tiers_empty(llm)
    llm.llm_engine.shutdown()
    assert _tier_files(str(tmp_path)) == []


def test_latents_live_in_the_tier_and_only_index_keys_in_ram(tiny_model_dir, tmp_path) -> None:
    from pagedserve.attention.kv_page_layout import kv_cache_components

    llm = _engine(tiny_model_dir("glm-moe-dsa"), sparse_kv_offload=_offload(str(tmp_path)))
    offload = llm.llm_engine.engine_core.executor.worker.kv_offload
    tier_storage = offload.tier.layer_views[0].untyped_storage().data_ptr()
    components = []
    for layer, tier_rows in zip(offload.layers, offload.tier.layer_views):
        assert layer.kv_cache is tier_rows and tier_rows.untyped_storage().data_ptr() == tier_storage
        assert layer.decode_row_gather is not None
        components.append({name: tuple(view.shape) for name, view in kv_cache_components(layer.kv_cache).items()
                           if view is not tier_rows})
    # GLM-5's full, shared, full layers: keys [blocks, block_size, index_head_dim] for the full ones only.
    assert components == [{"index_key": (128, BLOCK_SIZE, 16)}, {}, {"index_key": (128, BLOCK_SIZE, 16)}]
    llm.llm_engine.shutdown()


def test_multiprocess_worker_offloads_and_reports(tiny_model_dir, tmp_path) -> None:
    folder = tiny_model_dir("deepseek-v32")
    llm = _engine(folder, sparse_kv_offload=_offload(str(tmp_path)), distributed_executor_backend="mp")
    assert _tier_files(str(tmp_path)) == [] and _mapped_tier_files(str(tmp_path)) == []  # the worker maps it
    check_outputs_equal(_resident_tokens(folder), _generate(llm))
    stats = llm.llm_engine.engine_core.make_stats().sparse_kv_offload  # came back from the worker process
    assert stats.num_blocks_moved_in == stats.num_block_misses > 0
    _assert_tiers_empty(llm)
    llm.llm_engine.shutdown()
    assert _tier_files(str(tmp_path)) == []


def test_abort_frees_both_tiers(tiny_model_dir, tmp_path) -> None:
    llm = _engine(tiny_model_dir("deepseek-v32"), sparse_kv_offload=_offload(str(tmp_path)))
    engine = llm.llm_engine
    request_ids = []
    for prompt in PROMPTS[1:3]:
        request_ids.append(engine.next_request_id())
        engine.add_request(request_ids[-1], {"prompt_token_ids": prompt}, GREEDY)
    for _ in range(6):
        engine.step()
    stats = engine.engine_core.make_stats()
    assert stats.kv_cache_usage > 0 and stats.sparse_kv_offload.num_resident_buffers == 2 * 2  # requests x layers
    engine.abort_request(request_ids)
    _assert_tiers_empty(llm)
    engine.shutdown()
    assert _tier_files(str(tmp_path)) == []


def test_model_without_indexer_is_refused_naming_the_knob(tiny_model_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match="sparse_kv_offload needs a model whose attention runs a lightning "
                                         "indexer .*DeepseekV3ForCausalLM has none"):
        _engine(tiny_model_dir("deepseek-v3"), sparse_kv_offload=_offload(str(tmp_path)))
    assert _tier_files(str(tmp_path)) == []


def test_int8_cache_with_offload_is_refused_naming_both_knobs(tiny_model_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match="sparse_kv_offload cannot be combined with kv_cache_dtype='int8'"):
        _engine(tiny_model_dir("deepseek-v32"), kv_cache_dtype="int8", sparse_kv_offload=_offload(str(tmp_path)))
