"""Pipeline parallel: the layer split, per-stage building and loading, and PP=2 over the 'mp' executor
(2 gloo worker processes) equal to one process, token for token."""
from __future__ import annotations

import os
import random
import re

import pytest
import torch
from safetensors import safe_open

from paged_inputs import build_attention_metadata
from pagedserve import LLM, SamplingParams
from pagedserve.attention.forward_context import set_forward_context
from pagedserve.config.model import ModelConfig
from pagedserve.config.parallel import ParallelConfig
from pagedserve.distributed import parallel_state
from pagedserve.distributed.parallel_state import GroupCoordinator, ParallelSizes, group_rank_lists
from pagedserve.distributed.pipeline_comm import IntermediateTensors
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.executor.multiproc import output_rank
from pagedserve.model_loader import load_model
from pagedserve.models.pipeline_split import (PipelineMissingLayer, PipelineStage, pipeline_layer_counts,
                                              pipeline_layer_range, stage_weights)
from pagedserve.worker.kv_cache_allocation import attention_layers
from worker_death_checks import kill_worker_mid_generation

NUM_LAYERS = 5  # split [3, 2] over two stages
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
ENGINE_KWARGS = dict(max_model_len=256, num_kv_blocks=96, max_num_batched_tokens=64, enable_chunked_prefill=True)


# ---- the layer split ------------------------------------------------------------------------------

@pytest.mark.parametrize("num_layers, num_stages, counts", [
    (5, 2, [3, 2]), (4, 2, [2, 2]), (2, 2, [1, 1]), (6, 4, [1, 2, 2, 1]), (7, 4, [2, 2, 2, 1]),
    (9, 4, [2, 2, 3, 2]), (32, 3, [11, 11, 10]), (3, 1, [3]),
])
def test_layer_counts_follow_the_rule(num_layers: int, num_stages: int, counts: list[int]) -> None:
    assert pipeline_layer_counts(num_layers, num_stages) == counts


def test_layer_ranges_tile_the_decoder() -> None:
    for num_stages in range(1, 7):
        for num_layers in range(num_stages, 40):
            ranges = [pipeline_layer_range(num_layers, stage, num_stages) for stage in range(num_stages)]
            assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
            assert all(ranges[i][1] == ranges[i + 1][0] for i in range(num_stages - 1))
            sizes = [end - start for start, end in ranges]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
            assert sizes[-1] == min(sizes)  # the last stage (LM head, sampler) never carries an extra layer


def test_bad_split_names_the_knob() -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's num_hidden_layers=2"):
        pipeline_layer_counts(2, 3)
    with pytest.raises(ValueError, match="pipeline_parallel_size=0"):
        pipeline_layer_counts(2, 0)
    with pytest.raises(ValueError, match=r"pipeline stage 2 must be in \[0, 1\]"):
        pipeline_layer_range(4, 2, 2)


def test_config_rejects_more_stages_than_layers(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's num_hidden_layers=2"):
        LLM(tiny_model_dir("llama"), pipeline_parallel_size=3)


def test_profiling_chunks_with_pipeline_parallel_is_rejected(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="profiling_chunk_config.enable=True.*pipeline_parallel_size=2"):
        LLM(tiny_model_dir("llama"), pipeline_parallel_size=2, profiling_chunk_config={"enable": True})


def test_async_scheduling_with_pipeline_parallel_is_rejected(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="async_scheduling=True is not supported with pipeline_parallel_size=2"):
        LLM(tiny_model_dir("llama"), pipeline_parallel_size=2, async_scheduling=True)


# ---- rank and group mapping (fabricated worlds; TP x PP needs more processes than this machine has) --

def test_tp_x_pp_groups_and_output_rank() -> None:
    groups = group_rank_lists(ParallelSizes(tensor_parallel_size=2, pipeline_parallel_size=2))
    assert groups["tp"] == [[0, 1], [2, 3]]
    assert groups["pp"] == [[0, 2], [1, 3]]  # same TP index, one rank per stage
    assert groups["ep"] == [[0, 1], [2, 3]]  # MoE experts split over one stage's ranks
    assert output_rank(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)) == 2

    groups = group_rank_lists(ParallelSizes(tensor_parallel_size=2, pipeline_parallel_size=3))
    assert groups["pp"] == [[0, 2, 4], [1, 3, 5]]
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5]]
    assert output_rank(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3)) == 4

    groups = group_rank_lists(ParallelSizes(tensor_parallel_size=1, pipeline_parallel_size=4,
                                            data_parallel_size=2))
    assert groups["pp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert output_rank(ParallelConfig(pipeline_parallel_size=4)) == 3
    assert output_rank(ParallelConfig(tensor_parallel_size=4)) == 0


# ---- which checkpoint tensors a stage loads --------------------------------------------------------

CHECKPOINT_NAMES = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                    *(f"model.layers.{i}.self_attn.q_proj.weight" for i in range(4)),
                    "model.layers.4.mtp.weight"]  # a layer past the decoder passes through


def _kept(stage: PipelineStage, tied: bool) -> list[str]:
    return [name for name, _ in stage_weights(((n, None) for n in CHECKPOINT_NAMES), stage, 4, tied)]


def test_stage_weights_keep_only_the_stage_share() -> None:
    first, last = PipelineStage.of(4, 0, 2), PipelineStage.of(4, 1, 2)
    assert _kept(first, tied=False) == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                                        "model.layers.1.self_attn.q_proj.weight", "model.layers.4.mtp.weight"]
    assert _kept(last, tied=False) == ["lm_head.weight", "model.norm.weight",
                                       "model.layers.2.self_attn.q_proj.weight",
                                       "model.layers.3.self_attn.q_proj.weight", "model.layers.4.mtp.weight"]
    # Tied: the last stage's head is loaded from the embedding tensor (a checkpoint's head copy is dropped).
    assert _kept(first, tied=True) == _kept(first, tied=False)
    assert _kept(last, tied=True) == ["lm_head.weight", "model.norm.weight",
                                      "model.layers.2.self_attn.q_proj.weight",
                                      "model.layers.3.self_attn.q_proj.weight", "model.layers.4.mtp.weight"]
    renamed = dict(stage_weights([("model.embed_tokens.weight", "E"), ("lm_head.weight", "H")], last, 4, True))
    assert renamed == {"lm_head.weight": "E"}
    single = PipelineStage.of(4)
    assert _kept(single, tied=True) == CHECKPOINT_NAMES


# ---- one stage's model, built in this process under a fabricated PP group ---------------------------

def _build_stage(folder: str, stage_index: int, num_stages: int, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    group = GroupCoordinator(name="pp", rank=stage_index, world_size=num_stages, ranks=list(range(num_stages)))
    monkeypatch.setitem(parallel_state._groups, "pp", group)
    try:
        return load_model(ModelConfig(model=folder), "cpu")
    finally:
        monkeypatch.setitem(parallel_state._groups, "pp", GroupCoordinator(name="pp"))


def _checkpoint_bytes(folder: str, keep: "re.Pattern[str]") -> int:
    total = 0
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as handle:
        for name in handle.keys():
            if keep.match(name):
                tensor = handle.get_slice(name)
                total += int(torch.Size(tensor.get_shape()).numel()) * 4  # float32 checkpoint
    return total


def _parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _bind_scratch_caches(model: torch.nn.Module, num_blocks: int = 16, block_size: int = 16) -> None:
    for layer in attention_layers(model):
        layer.kv_cache = torch.zeros(layer.kv_cache_spec().tensor_shape(num_blocks, block_size))


@torch.inference_mode()
def _run_split(full: torch.nn.Module, stages: list[torch.nn.Module], steps: list[tuple[list[int], int]]) -> None:
    """Run each (token ids, computed tokens) step through the full model and through the stages chained
    by hand; the last stage's hidden states and logits must equal the full model's."""
    for model in (full, *stages):
        _bind_scratch_caches(model)
    for token_ids, num_computed in steps:
        metadata, positions = build_attention_metadata([len(token_ids)], [num_computed], [[3, 5, 7]], 16)
        input_ids = torch.tensor(token_ids)
        with set_forward_context(metadata):
            expected = full(input_ids, positions)
        intermediate = None
        for model in stages:
            with set_forward_context(metadata):
                intermediate = model(input_ids, positions, intermediate)
            if model is not stages[-1]:
                assert isinstance(intermediate, IntermediateTensors)
                assert intermediate.hidden_states.shape == intermediate.residual.shape == expected.shape
        torch.testing.assert_close(intermediate, expected, rtol=0, atol=0)
        torch.testing.assert_close(stages[-1].compute_logits(intermediate), full.compute_logits(expected),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3-moe"])
def test_stage_models_hold_their_share_and_chain_to_the_full_model(
        kind: str, tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tiny_model_dir(kind, num_hidden_layers=NUM_LAYERS)
    full = load_model(ModelConfig(model=folder), "cpu")
    first, last = (_build_stage(folder, index, 2, monkeypatch) for index in range(2))
    tied = bool(full.config.tie_word_embeddings)
    assert tied == (kind == "qwen3")

    first_names = {name for name, _ in first.named_parameters()}
    last_names = {name for name, _ in last.named_parameters()}
    layer_indices = lambda names: {int(m[1]) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    assert layer_indices(first_names) == {0, 1, 2} and layer_indices(last_names) == {3, 4}
    assert "model.embed_tokens.weight" in first_names and "lm_head.weight" not in first_names
    assert "model.norm.weight" not in first_names
    assert "model.embed_tokens.weight" not in last_names and {"lm_head.weight", "model.norm.weight"} <= last_names
    assert isinstance(first.lm_head, PipelineMissingLayer) and isinstance(last.model.embed_tokens, PipelineMissingLayer)
    assert all(isinstance(last.model.layers[i], PipelineMissingLayer) for i in range(3))
    # Missing layers allocate nothing: the stages' parameters add up to the checkpoint, split as expected.
    first_pattern = re.compile(r"model\.embed_tokens\.|model\.layers\.[012]\.")
    last_pattern = re.compile(r"model\.layers\.[34]\.|model\.norm\.|lm_head\." + (r"|model\.embed_tokens\." if tied else ""))
    assert _parameter_bytes(first) == _checkpoint_bytes(folder, first_pattern)
    assert _parameter_bytes(last) == _checkpoint_bytes(folder, last_pattern)
    # KV caches exist only for the stage's own attention layers.
    assert len(attention_layers(first)) == 3 and len(attention_layers(last)) == 2
    if tied:  # the last stage's own head holds the embedding's values
        torch.testing.assert_close(last.lm_head.weight, full.model.embed_tokens.weight, rtol=0, atol=0)

    rng = random.Random(5)
    prompt = [rng.randrange(8, 500) for _ in range(21)]
    _run_split(full, [first, last], [(prompt, 0), ([rng.randrange(8, 500)], 21), ([17, 18, 19], 22)])


# ---- PP=2 end to end over the 'mp' executor --------------------------------------------------------

def _prompts() -> list[dict]:
    rng = random.Random(3)
    prompts = [[rng.randrange(8, 600) for _ in range(rng.randint(3, 90))] for _ in range(5)]
    return [{"prompt_token_ids": ids} for ids in prompts]


SHARED_PREFIX = [(7 * i + 11) % 590 + 8 for i in range(40)]  # two and a half blocks


def _generate(llm: LLM, prompts: list[dict], params: SamplingParams | list[SamplingParams] = GREEDY):
    return llm.generate(prompts, params, use_tqdm=False)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def folder(tiny_model_dir) -> str:
    return tiny_model_dir("llama", num_hidden_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def pp2(folder: str):
    llm = LLM(folder, pipeline_parallel_size=2, **ENGINE_KWARGS)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def reference(folder: str) -> LLM:
    return LLM(folder, **ENGINE_KWARGS)


def test_pp2_greedy_equals_single_process(pp2: LLM, reference: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine_core = pp2.llm_engine.engine_core
    assert engine_core.executor.max_concurrent_batches == 2
    queue = engine_core.batch_queue
    num_in_flight: list[int] = []
    submit = queue.submit

    def recording_submit(*args, **kwargs):
        step = submit(*args, **kwargs)
        num_in_flight.append(len(queue))
        return step

    monkeypatch.setattr(queue, "submit", recording_submit)
    # Prompts of 3..90 tokens under a 64-token budget: chunked prefill mixed with decodes.
    outputs = _tokens(_generate(pp2, _prompts()))
    assert outputs == _tokens(_generate(reference, _prompts()))
    # Two micro-batches were in the pipeline at once (one per stage), never more.
    assert max(num_in_flight) == 2 and num_in_flight.count(2) >= 10, num_in_flight
    assert all(len(tokens) == 32 for tokens in outputs)
    assert len({tuple(tokens) for tokens in outputs}) == len(outputs)


def test_pp2_prefix_cache_hit_equals_single_process(pp2: LLM, reference: LLM) -> None:
    first = [{"prompt_token_ids": SHARED_PREFIX + [31, 32, 33]}]
    second = [{"prompt_token_ids": SHARED_PREFIX + [41, 42]}, {"prompt_token_ids": SHARED_PREFIX + [51]}]
    for llm in (pp2, reference):
        llm.llm_engine.engine_core.scheduler.kv_cache_manager.reset_prefix_cache()
    pp_first, ref_first = _generate(pp2, first), _generate(reference, first)
    pp_second, ref_second = _generate(pp2, second), _generate(reference, second)
    assert _tokens(pp_first) == _tokens(ref_first)
    assert _tokens(pp_second) == _tokens(ref_second)
    assert all(output.num_cached_tokens >= 32 for output in pp_second)  # two full blocks came from the cache


def test_pp2_seeded_sampling_equals_single_process(pp2: LLM, reference: LLM) -> None:
    # The last stage samples with the request's generator; the first stage learns the tokens from deltas.
    seeded = [SamplingParams(temperature=0.9, top_k=20, seed=11 + i, max_tokens=32, ignore_eos=True)
              for i in range(5)]
    assert _tokens(_generate(pp2, _prompts(), seeded)) == _tokens(_generate(reference, _prompts(), seeded))


def test_each_stage_loads_and_caches_only_its_layers(folder: str, pp2: LLM, reference: LLM) -> None:
    executor = pp2.llm_engine.engine_core.executor
    assert executor.output_rank == 1
    first = _checkpoint_bytes(folder, re.compile(r"model\.embed_tokens\.|model\.layers\.[012]\."))
    last = _checkpoint_bytes(folder, re.compile(r"model\.layers\.[34]\.|model\.norm\.|lm_head\."))
    assert first + last == os.path.getsize(os.path.join(folder, "model.safetensors")) - _header_bytes(folder)
    assert executor.parameter_bytes == [first, last]
    assert executor.weight_bytes_read == [first, last]  # other stages' tensors are never read
    single_kv_bytes = reference.llm_engine.engine_core.runtime_info.kv_cache_bytes
    assert executor.kv_cache_bytes == [single_kv_bytes * 3 // 5, single_kv_bytes * 2 // 5]


def _header_bytes(folder: str) -> int:
    with open(os.path.join(folder, "model.safetensors"), "rb") as handle:
        return 8 + int.from_bytes(handle.read(8), "little")


@pytest.mark.parametrize("kind, num_layers", [("qwen3", 3), ("qwen3-moe", NUM_LAYERS)])
def test_pp2_tied_qwen3_and_moe_equal_single_process(kind: str, num_layers: int, tiny_model_dir) -> None:
    # Qwen3's tiny model ties its embeddings: the last stage's head is loaded from the embedding tensor.
    folder = tiny_model_dir(kind, num_hidden_layers=num_layers)
    prompts = _prompts()[:3]
    reference = _tokens(_generate(LLM(folder, **ENGINE_KWARGS), prompts))
    pp2 = LLM(folder, pipeline_parallel_size=2, **ENGINE_KWARGS)
    try:
        assert _tokens(_generate(pp2, prompts)) == reference
    finally:
        pp2.llm_engine.shutdown()


def test_killed_stage_raises_promptly_and_leaves_no_process(folder: str) -> None:
    engine = LLMEngine.from_kwargs(folder, pipeline_parallel_size=2, max_model_len=256, num_kv_blocks=64)
    executor = engine.engine_core.executor
    processes = list(executor.processes)
    try:
        # The first stage dies: the last stage is left blocked in its receive, the executor waits on it.
        kill_worker_mid_generation(engine, executor.worker_pids[0], rank=0)
    finally:
        engine.shutdown()
    for process in processes:
        process.join(10)
        assert not process.is_alive(), process.pid
