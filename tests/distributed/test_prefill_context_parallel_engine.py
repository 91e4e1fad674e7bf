"""Prefill context parallel over two gloo ranks (prefill_context_parallel_size=2, added ranks that split each step's
tokens and each request's KV positions): float32 greedy tokens equal to one process for dense attention (GQA), MLA and
DeepSeek sparse attention, with prompts of several blocks, chunked prefill and prefix-cache hits; the KV capacity
doubles; bad combinations fail at start naming the knobs."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config.engine import EngineConfig
from pagedserve.config.parallel import ParallelConfig
from pagedserve.distributed.parallel_state import GroupCoordinator, ParallelSizes, group_rank_lists
from pagedserve.distributed.prefill_context_parallel import TokenSplit

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def _prompts() -> list[list[int]]:
    """Two prompts sharing a 70-token prefix (more than two 32-position blocks of the PCP pair), a short one and a
    long one (five blocks)."""
    rng = random.Random(7)
    shared = [rng.randrange(8, 600) for _ in range(70)]
    return [shared + [rng.randrange(8, 600) for _ in range(9)], [rng.randrange(8, 600) for _ in range(3)],
            shared + [rng.randrange(8, 600) for _ in range(25)], [rng.randrange(8, 600) for _ in range(150)]]


PROMPTS = _prompts()
# A budget below the prompts: chunked prefill, chunks mixed with decodes, and uneven token counts per step.
ENGINE = dict(dtype="float32", max_model_len=256, num_kv_blocks=48, max_num_batched_tokens=40, max_num_seqs=4)


def _generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("kind", ["llama", "deepseek-v3", "deepseek-v32"])
def test_pcp_2_equals_one_process(tiny_model_dir, kind: str) -> None:
    """Dense GQA (Llama), MLA (DeepSeek-V3) and DSA (DeepSeek-V3.2, index_topk 8: the top-k of the union of the
    ranks' candidates) generate what one process does, first from scratch, then with the shared prefix cached."""
    folder = tiny_model_dir(kind)
    single = _generate(LLM(folder, **ENGINE))
    llm = LLM(folder, prefill_context_parallel_size=2, enable_prefix_caching=True, **ENGINE)
    core = llm.llm_engine.engine_core
    try:
        first = _generate(llm)
        hits_before = core.make_stats().prefix_cache_hits
        second = _generate(llm)  # the shared prefix and the prompts themselves now come from the prefix cache
        assert core.make_stats().prefix_cache_hits - hits_before >= 64 * 2
    finally:
        llm.llm_engine.shutdown()
    assert first == single
    assert second == single


@pytest.mark.slow
def test_pcp_2_with_tp_2_and_dcp_2_equals_one_process(tiny_model_dir, monkeypatch) -> None:
    """Four processes (PCP=2 x TP=2, DCP=2 inside each TP pair): MLA's positions split over all four ranks, the
    absorbed queries gathered over the DCP pair and the steps' tokens over the PCP pair (slow: 4 processes on the
    CI's 2 cores, admitted by pretending 4 cores; the PCP=2 runs above cover the same code with a group of 2)."""
    folder = tiny_model_dir("deepseek-v3")
    single = _generate(LLM(folder, **ENGINE))
    monkeypatch.setattr("pagedserve.config.engine.os.cpu_count", lambda: 4)
    llm = LLM(folder, prefill_context_parallel_size=2, tensor_parallel_size=2, decode_context_parallel_size=2,
              **ENGINE)
    try:
        assert _generate(llm) == single
    finally:
        llm.llm_engine.shutdown()


def test_group_layout() -> None:
    """vLLM's rank order (dp, pp, pcp, tp): PCP groups pair equal TP indices; the KV group is PCP x DCP."""
    groups = group_rank_lists(ParallelSizes(tensor_parallel_size=2, prefill_context_parallel_size=2,
                                            decode_context_parallel_size=2))
    assert groups["tp"] == [[0, 1], [2, 3]] and groups["pcp"] == [[0, 2], [1, 3]]
    assert groups["dcp"] == [[0, 1], [2, 3]] and groups["cp_kv"] == [[0, 1, 2, 3]]
    groups = group_rank_lists(ParallelSizes(tensor_parallel_size=2, prefill_context_parallel_size=2))
    assert groups["cp_kv"] == [[0, 2], [1, 3]] and groups["ep"] == [[0, 1], [2, 3]]


def test_token_split_pads_the_last_run() -> None:
    """5 tokens over 2 ranks: rows 0-2 on rank 0, rows 3-4 and one zero row of padding on rank 1."""
    rows = torch.arange(5)
    first = TokenSplit(GroupCoordinator(rank=0, world_size=2, ranks=[0, 1]), 5)
    second = TokenSplit(GroupCoordinator(rank=1, world_size=2, ranks=[0, 1]), 5)
    assert first.local(rows).tolist() == [0, 1, 2] and second.local(rows).tolist() == [3, 4, 0]
    assert (first.num_local, second.start) == (3, 3)


def test_cli_flag() -> None:
    """`--prefill-context-parallel-size` / `-pcp` map to the keyword of the same name."""
    import argparse

    from pagedserve.config.cli_args import add_engine_args, parallel_engine_kwargs_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for flag in ("--prefill-context-parallel-size", "-pcp"):
        args = parser.parse_args([flag, "2"])
        assert parallel_engine_kwargs_from_args(args)["prefill_context_parallel_size"] == 2


def test_world_arithmetic_and_capacity() -> None:
    """PCP adds ranks (world = TP x PP x PCP), the output rank is TP rank 0 of PCP rank 0 of the last stage, and a
    block id covers block_size x PCP x DCP positions; the capacity line states the arithmetic."""
    from pagedserve.executor.multiproc import output_rank

    config = ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2, prefill_context_parallel_size=2)
    assert (config.world_size_per_engine, config.context_parallel_size, output_rank(config)) == (4, 4, 0)
    assert config.kv_split_note() == (
        " on each of 4 context-parallel ranks (prefill_context_parallel_size=2 x decode_context_parallel_size=2), "
        "which split the positions; world: tensor_parallel_size=2 x pipeline_parallel_size=1 x "
        "prefill_context_parallel_size=2 = 4 processes")
    assert ParallelConfig().kv_split_note() == ""


def test_pcp_doubles_the_positions_a_block_budget_holds(tiny_model_dir) -> None:
    """9 blocks (one is the null block) hold 8 x 16 positions on one rank, 8 x 32 over a PCP pair: the budget one
    process refuses for max_model_len=256 is accepted (the engine tests serve with the same block arithmetic)."""
    folder = tiny_model_dir("deepseek-v3")
    with pytest.raises(ValueError, match="fewer than max_model_len=256"):
        LLM(folder, dtype="float32", max_model_len=256, num_kv_blocks=9)
    config = EngineConfig.create(folder, dtype="float32", max_model_len=256, num_kv_blocks=9,
                                 prefill_context_parallel_size=2)
    assert config.tokens_per_block == 32 and config.attention_backend == "decode_context_parallel"


@pytest.mark.parametrize("kwargs, message", [
    (dict(prefill_context_parallel_size=0), "prefill_context_parallel_size=0 must be an integer >= 1"),
    (dict(prefill_context_parallel_size=2, attention_backend="torch_paged"),
     "attention_backend='torch_paged' does not split KV positions over ranks; with prefill_context_parallel_size=2"),
    (dict(prefill_context_parallel_size=2, batch_invariant=True),
     "batch_invariant=True has no context-parallel form"),
    (dict(prefill_context_parallel_size=2, pipeline_parallel_size=2),
     "prefill_context_parallel_size=2 is not supported with pipeline_parallel_size=2"),
    (dict(prefill_context_parallel_size=2, tensor_parallel_size=2, enable_sequence_parallel=True, kind="llama"),
     "prefill_context_parallel_size=2 is not supported with enable_sequence_parallel=True"),
    (dict(prefill_context_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True),
     "prefill_context_parallel_size=2 is not supported with enable_expert_parallel=True"),
    (dict(prefill_context_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     r"prefill_context_parallel_size=2 does not support speculative decoding yet \(speculative_config.method="
     r"'ngram'\)"),
    (dict(prefill_context_parallel_size=2, profiling_chunk_config={"enable": True}),
     "profiling_chunk_config.enable=True times forwards without the context-parallel split, but "
     "prefill_context_parallel_size=2"),
    (dict(prefill_context_parallel_size=2, kind="deepseek-v32", sparse_kv_offload={"num_resident_blocks": 4}),
     "sparse_kv_offload is not supported with prefill_context_parallel_size=2"),
    (dict(prefill_context_parallel_size=2, kv_transfer_config={"kv_connector": "PullConnector", "kv_role": "kv_both"}),
     "decode_context_parallel_size and prefill_context_parallel_size must be 1"),
])
def test_bad_combinations_fail_at_start(tiny_model_dir, kwargs: dict, message: str) -> None:
    kind = kwargs.pop("kind", "deepseek-v3")
    with pytest.raises(ValueError, match=message):
        EngineConfig.create(tiny_model_dir(kind), **kwargs)


def test_unsupported_architectures_are_refused() -> None:
    """An attention type without a context-parallel form (here a made-up state-space model) fails at start."""
    hf_config = SimpleNamespace(architectures=["MambaForCausalLM"], num_attention_heads=4, num_key_value_heads=4,
                                vocab_size=512, num_hidden_layers=2, tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"prefill_context_parallel_size=2 splits dense \(GQA, sliding window\), "
                                         r"MLA and DeepSeek sparse attention.*the model is \['MambaForCausalLM'\]"):
        ParallelConfig(prefill_context_parallel_size=2).validate_for_model(hf_config, num_cpus=None, num_devices=None)
