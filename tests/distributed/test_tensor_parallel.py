"""Tensor parallel over the 'mp' executor (2 gloo worker processes) equals one process, token for token."""
from __future__ import annotations

import os
import random

import pytest

from pagedserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _prompts() -> list[dict]:
    rng = random.Random(3)
    return [{"prompt_token_ids": [rng.randrange(8, 600) for _ in range(rng.randint(3, 70))]} for _ in range(5)]


def _tokens(llm: LLM, params: SamplingParams | list[SamplingParams] = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def folder(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def tp2(folder: str):
    llm = LLM(folder, max_model_len=256, num_kv_blocks=96, max_num_batched_tokens=64, tensor_parallel_size=2)
    yield llm
    llm.llm_engine.shutdown()


def test_tp2_greedy_equals_single_process(folder: str, tp2: LLM) -> None:
    reference = LLM(folder, max_model_len=256, num_kv_blocks=96, max_num_batched_tokens=64)
    assert _tokens(tp2) == _tokens(reference)
    # Seeded top-k sampling too: every rank samples the same gathered logits with the same generators.
    seeded = [SamplingParams(temperature=0.9, top_k=20, seed=11 + i, max_tokens=12, ignore_eos=True)
              for i in range(5)]
    assert _tokens(tp2, seeded) == _tokens(reference, seeded)


def test_each_rank_reads_only_its_slices(folder: str, tp2: LLM) -> None:
    executor = tp2.llm_engine.engine_core.executor
    file_bytes = os.path.getsize(os.path.join(folder, "model.safetensors"))
    assert len(executor.weight_bytes_read) == 2
    for bytes_read in executor.weight_bytes_read:
        # Norms are replicated (tiny); every matrix is split in two.
        assert 0.45 * file_bytes < bytes_read < 0.55 * file_bytes, (bytes_read, file_bytes)


def test_workers_exit_on_shutdown(folder: str) -> None:
    llm = LLM(folder, max_model_len=128, num_kv_blocks=32, tensor_parallel_size=2)
    processes = list(llm.llm_engine.engine_core.executor.processes)
    assert all(p.is_alive() for p in processes)
    del llm  # garbage collection reaps the workers
    import gc

    gc.collect()
    for process in processes:
        process.join(10)
        assert not process.is_alive()
