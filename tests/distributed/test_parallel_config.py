"""ParallelConfig validation, CLI flags, group layout and lazy checkpoint slices (no processes spawned)."""
from __future__ import annotations

import argparse
import os

import pytest
import torch

from pagedserve.config.cli_args import add_engine_args, engine_kwargs_from_args
from pagedserve.config.engine import EngineConfig
from pagedserve.config.parallel import DyntraLBConfig, ParallelConfig
from pagedserve.distributed import parallel_state
from pagedserve.distributed.parallel_state import GroupCoordinator, ParallelSizes, group_rank_lists


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=3), "num_attention_heads=4"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size=0"),
    (dict(pipeline_parallel_size=3), "num_hidden_layers=2"),
    (dict(tensor_parallel_size=2, lmhead_tensor_parallel_size=3), "lmhead_tensor_parallel_size=3"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "distributed_executor_backend='uni'"),
    (dict(distributed_executor_backend="threads"), "distributed_executor_backend='threads'"),
    (dict(enable_reduce_sample=True), "enable_reduce_sample=True"),
    (dict(enable_balance_scheduling=True), "data_parallel_size=1"),
    (dict(data_parallel_size=2, enable_balance_scheduling=True, dyntra_lb_config={"enabled": True}),
     "mutually exclusive"),
    (dict(data_parallel_size=64), "CPU core"),
    (dict(data_parallel_size=2, enable_expert_parallel=True), "enable_expert_parallel=True with data_parallel_size=2"),
    (dict(dyntra_lb_config={"bubble": 1}), "unknown keys"),
    (dict(dyntra_lb_config='{"bubble_threshold": 0}'), "bubble_threshold=0"),
])
def test_bad_parallel_knobs_are_rejected(tiny_model_dir, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        EngineConfig.create(tiny_model_dir("llama"), **kwargs)


def test_kv_heads_must_divide_or_be_divided(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama", num_attention_heads=4, num_key_value_heads=4, hidden_size=64)
    config = EngineConfig.create(folder, tensor_parallel_size=2)
    assert config.parallel_config.executor_backend == "mp"
    hf_config = config.model_config.hf_config
    hf_config_copy = type(hf_config)(**{**hf_config.to_dict(), "num_attention_heads": 6, "num_key_value_heads": 3,
                                        "hidden_size": 96})
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        ParallelConfig(tensor_parallel_size=2).validate_for_model(hf_config_copy, num_cpus=8, num_devices=None)


def test_tied_model_needs_equal_head_and_embedding_degrees(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="lmhead_tensor_parallel_size=1 and embedding_tensor_parallel_size=0"):
        EngineConfig.create(tiny_model_dir("llama-tied"), tensor_parallel_size=2, lmhead_tensor_parallel_size=1)


def test_cli_flags_map_to_keywords(tiny_model_dir) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", tiny_model_dir("llama"), "--tensor-parallel-size", "2",
                              "--oproj-tensor-parallel-size", "1", "--enable-reduce-sample",
                              "--distributed-executor-backend", "mp", "--data-parallel-size", "2",
                              "--dyntra-lb-config", '{"enabled": true, "bubble_threshold": 0.25}'])
    kwargs = engine_kwargs_from_args(args)
    config = EngineConfig.create(**{**kwargs, "data_parallel_size": 1, "dyntra_lb_config": None})
    parallel = config.parallel_config
    assert (parallel.tensor_parallel_size, parallel.oproj_degree, parallel.lmhead_degree) == (2, 1, 2)
    assert parallel.enable_reduce_sample and parallel.executor_backend == "mp"
    assert DyntraLBConfig.parse(kwargs["dyntra_lb_config"]).bubble_threshold == 0.25
    assert kwargs["data_parallel_size"] == 2


def test_group_layout() -> None:
    groups = group_rank_lists(ParallelSizes(tensor_parallel_size=4, pipeline_parallel_size=1, data_parallel_size=2,
                                            lmhead_tensor_parallel_size=2, oproj_tensor_parallel_size=2))
    assert groups["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["ep"] == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert groups["lmhead_tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["embedding_tp"] == groups["tp"]  # 0: same as TP
    # o_proj degree 2 in TP 4: heads of ranks (0,1) form shard 0, (2,3) shard 1; shards sum over (0,2), (1,3).
    assert groups["oproj_gather"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["oproj_tp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    pp = group_rank_lists(ParallelSizes(tensor_parallel_size=2, pipeline_parallel_size=2))
    assert pp["pp"] == [[0, 2], [1, 3]] and pp["ep"] == [[0, 1], [2, 3]]


def test_size_one_collectives_are_identity() -> None:
    group = parallel_state.get_ep_group()
    tensor = torch.arange(6.0).reshape(3, 2)
    assert group.world_size == 1 and group.rank == 0
    assert group.all_reduce(tensor) is tensor
    assert group.all_gather(tensor) is tensor
    assert group.all_to_all_single(tensor) is tensor


def test_sliced_loading_reads_only_the_rank_slice(tiny_model_dir, monkeypatch) -> None:
    from pagedserve.config.model import ModelConfig
    from pagedserve.model_loader import load_model
    from pagedserve.model_loader.checkpoint_slice import bytes_read, iterate_safetensors_slices, reset_bytes_read

    folder = tiny_model_dir("llama")
    config = EngineConfig.create(folder, max_model_len=128, num_kv_blocks=16)
    model_config: ModelConfig = config.model_config
    full = load_model(model_config, "cpu")
    file_bytes = os.path.getsize(os.path.join(folder, "model.safetensors"))
    for rank in (0, 1):
        # Simulate rank `rank` of a TP=2 world: loading needs only ranks and sizes, no collectives.
        groups = {name: GroupCoordinator(name=name, rank=rank, world_size=2, ranks=[0, 1])
                  for name in ("tp", "lmhead_tp", "embedding_tp", "oproj_tp")}
        groups["oproj_gather"] = GroupCoordinator(name="oproj_gather", rank=0, world_size=1, ranks=[rank])
        monkeypatch.setattr(parallel_state, "_groups", {**parallel_state._groups, **groups})
        reset_bytes_read()
        shard = load_model(model_config, "cpu", weights=iterate_safetensors_slices(folder, model_config.dtype))
        assert 0.45 * file_bytes < bytes_read() < 0.55 * file_bytes
        rows = full.model.layers[0].mlp.gate_up_proj.weight.shape[0] // 4
        expected = full.model.layers[0].mlp.gate_up_proj.weight[rank * rows:(rank + 1) * rows]
        assert torch.equal(shard.model.layers[0].mlp.gate_up_proj.weight[:rows], expected)
        columns = full.model.layers[1].self_attn.o_proj.weight.shape[1] // 2
        assert torch.equal(shard.model.layers[1].self_attn.o_proj.weight,
                           full.model.layers[1].self_attn.o_proj.weight[:, rank * columns:(rank + 1) * columns])
