"""CPU binding and profiling-tuned chunked prefill leave greedy outputs unchanged (float32, tiny llama)."""
from __future__ import annotations

import os

import pytest
import torch

from pagedserve import LLM, SamplingParams
from generation_helpers import generated_token_ids, random_prompts
from pagedserve.core.profiling_chunk_predictor import ProfilingChunkPolicy

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


def _prompts(num: int, low: int, high: int, seed: int) -> list[list[int]]:
    return random_prompts(num, low, high, seed)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return generated_token_ids(llm, prompts, GREEDY)


def test_cpu_binding_same_tokens(folder: str) -> None:
    prompts = _prompts(4, 5, 40, seed=7)
    reference = _generate(LLM(folder, max_model_len=128, num_kv_blocks=64), prompts)
    allowed, num_threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:  # the in-process worker binds this very process: restore it for the other tests
        bound = _generate(LLM(folder, max_model_len=128, num_kv_blocks=64, enable_cpu_binding=True), prompts)
        assert os.sched_getaffinity(0) <= allowed
    finally:
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(num_threads)
    assert bound == reference


def test_profiling_chunk_same_tokens_and_caps_chunks(folder: str) -> None:
    prompts = _prompts(5, 60, 120, seed=8)
    common = dict(max_model_len=256, num_kv_blocks=160, max_num_batched_tokens=128, enable_prefix_caching=False)
    reference = _generate(LLM(folder, **common), prompts)
    # A tiny step budget: every chunk falls to the 16-token floor, so long prompts take many steps.
    llm = LLM(folder, **common, profiling_chunk_config={
        "enable": True, "target_tpot_ms": 0.01, "chunk_sizes": [8, 16, 32, 64, 128], "history_sizes": [64],
        "min_chunk": 16, "smoothing": 1.0})
    core = llm.llm_engine.engine_core
    policy = core.scheduler.prefill_chunk_policy
    assert isinstance(policy, ProfilingChunkPolicy)
    assert len(core.runtime_info.chunk_latency_samples) == 6  # 5 chunk sizes + 1 history point
    scheduled: list[int] = []
    schedule = core.scheduler.schedule

    def recording_schedule():
        output = schedule()
        scheduled.extend(output.num_scheduled_tokens.values())
        return output

    core.scheduler.schedule = recording_schedule
    assert _generate(llm, prompts) == reference
    assert max(scheduled) == 16


def test_profiling_chunk_config_validation(folder: str) -> None:
    with pytest.raises(ValueError, match="smoothing=1.5"):
        LLM(folder, profiling_chunk_config='{"enable": true, "smoothing": 1.5}')
    with pytest.raises(ValueError, match="unknown keys"):
        LLM(folder, profiling_chunk_config={"enabled": True})
    with pytest.raises(ValueError, match="enable_chunked_prefill=False"):
        LLM(folder, max_model_len=128, enable_chunked_prefill=False, profiling_chunk_config={"enable": True})
    with pytest.raises(ValueError, match="enable_cpu_binding='yes'"):
        LLM(folder, enable_cpu_binding="yes")


def test_cli_flags_map_to_engine_keywords() -> None:
    import argparse

    from pagedserve.config.cli_args import add_engine_args, engine_kwargs_from_args
    from pagedserve.config.engine import engine_kwargs_names

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs_from_args(parser.parse_args(
        ["--enable-cpu-binding", "--profiling-chunk-config", '{"enable": true, "target_tpot_ms": 50}']))
    assert kwargs["enable_cpu_binding"] is True
    assert kwargs["profiling_chunk_config"] == '{"enable": true, "target_tpot_ms": 50}'
    defaults = engine_kwargs_from_args(parser.parse_args([]))
    assert defaults["enable_cpu_binding"] is False and defaults["profiling_chunk_config"] is None
    assert {"enable_cpu_binding", "profiling_chunk_config"} <= set(engine_kwargs_names())
