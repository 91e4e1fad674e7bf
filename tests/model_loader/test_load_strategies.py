"""safetensors_load_strategy x enable_multithread_load/num_threads: the same parameters, bit for bit;
tensor-parallel slices still read only the rank's bytes; readers release their threads and buffers."""
from __future__ import annotations

import argparse
import os
import shutil
import threading

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from pagedserve.config.cli_args import add_engine_args, engine_kwargs_from_args
from pagedserve.config.engine import EngineConfig
from pagedserve.config.load import LoadConfig
from pagedserve.config.model import ModelConfig
from pagedserve.distributed import GroupCoordinator, parallel_state
from pagedserve.model_loader import iterate_safetensors_weights, load_model, safetensors_weight_files
from pagedserve.model_loader.checkpoint_reader import (EagerCheckpointReader, PrefetchCheckpointReader,
                                                       open_checkpoint_reader)
from pagedserve.model_loader.checkpoint_slice import bytes_read, reset_bytes_read
from pagedserve.model_loader.load_strategies import load_checkpoint, partition_entries
from pagedserve.models.registry import resolve_model_class

STRATEGIES = ("lazy", "eager", "prefetch")


def _model_config(folder: str, dtype: torch.dtype = torch.float32) -> ModelConfig:
    return ModelConfig(model=folder, hf_config=AutoConfig.from_pretrained(folder, local_files_only=True),
                       dtype=dtype)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits (torch.equal alone would call -0.0 == 0.0 equal)."""
    return tensor.detach().contiguous().view(torch.uint8)


def _assert_bitwise_equal(model: torch.nn.Module, reference: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    assert params.keys() == reference.keys()
    for name, param in params.items():
        assert param.dtype == reference[name].dtype, name
        assert torch.equal(_bits(param), _bits(reference[name])), name


def _reference(folder: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The long-standing stream (safe_open, one tensor at a time) as the oracle."""
    model = load_model(_model_config(folder, dtype), "cpu", weights=iterate_safetensors_weights(folder, dtype))
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def _load_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("pagedserve-load", "pagedserve-prefetch"))]


@pytest.mark.parametrize("kind, shard_size, dtype", [
    ("qwen2", "40KB", torch.float32),       # several shards, q/k/v biases
    ("llama-tied", None, torch.bfloat16),   # one file, tied embeddings, fp32 checkpoint -> bf16
    ("qwen3-moe", "60KB", torch.float32),   # experts of one layer spread over shards
])
def test_every_strategy_and_thread_count_loads_the_same_bits(tiny_model_dir, kind, shard_size, dtype) -> None:
    folder = tiny_model_dir(kind, max_shard_size=shard_size) if shard_size else tiny_model_dir(kind)
    if shard_size:
        assert len(safetensors_weight_files(folder)) > 2
    reference = _reference(folder, dtype)
    for strategy in STRATEGIES:
        for num_threads in (1, 2, 3):
            load_config = LoadConfig(enable_multithread_load=num_threads > 1, num_threads=num_threads,
                                     safetensors_load_strategy=strategy)
            model = load_model(_model_config(folder, dtype), "cpu", load_config=load_config)
            _assert_bitwise_equal(model, reference)
            assert _load_threads() == [], (strategy, num_threads)


def test_multithread_load_runs_load_weights_in_several_threads(tiny_model_dir) -> None:
    folder = tiny_model_dir("qwen2", max_shard_size="40KB")
    config = _model_config(folder)
    with torch.device("cpu"):
        model = resolve_model_class(config.hf_config)(config.hf_config, config.dtype)
    callers: list[str] = []
    load_weights = model.load_weights

    def recording_load_weights(weights):  # type: ignore[no-untyped-def]
        callers.append(threading.current_thread().name)
        return load_weights(weights)

    model.load_weights = recording_load_weights  # type: ignore[method-assign]
    loaded = load_checkpoint(model, folder, config.dtype,
                             LoadConfig(enable_multithread_load=True, num_threads=2, safetensors_load_strategy="eager"))
    assert len(callers) == 2 and len(set(callers)) == 2 and all(n.startswith("pagedserve-load") for n in callers)
    assert loaded == {name for name, _ in model.named_parameters()}


def test_partition_keeps_each_layer_in_one_run_and_balances_bytes(tiny_model_dir) -> None:
    folder = tiny_model_dir("qwen2", max_shard_size="40KB")
    with open_checkpoint_reader(safetensors_weight_files(folder)) as reader:
        entries = reader.entries
    runs = partition_entries(entries, 2)
    assert len(runs) == 2 and sorted(e.name for run in runs for e in run) == sorted(e.name for e in entries)
    layers = [{e.name.split(".")[2] for e in run if e.name.startswith("model.layers.")} for run in runs]
    assert not layers[0] & layers[1]  # no layer is split between runs
    sizes = [sum(e.num_bytes for e in run) for run in runs]
    assert max(sizes) < 0.8 * sum(sizes)
    assert len(partition_entries(entries, 1)) == 1
    assert len(partition_entries(entries, 64)) <= len({e.name for e in entries})


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_tp2_ranks_read_only_their_slice_bytes(tiny_model_dir, monkeypatch, strategy, num_threads) -> None:
    folder = tiny_model_dir("llama")
    model_config = _model_config(folder)
    full = load_model(model_config, "cpu")
    file_bytes = os.path.getsize(os.path.join(folder, "model.safetensors"))
    load_config = LoadConfig(enable_multithread_load=num_threads > 1, num_threads=num_threads,
                             safetensors_load_strategy=strategy)
    for rank in (0, 1):
        # Rank `rank` of a TP=2 world: loading needs only ranks and sizes, no collectives.
        groups = {name: GroupCoordinator(name=name, rank=rank, world_size=2, ranks=[0, 1])
                  for name in ("tp", "lmhead_tp", "embedding_tp", "oproj_tp")}
        groups["oproj_gather"] = GroupCoordinator(name="oproj_gather", rank=0, world_size=1, ranks=[rank])
        monkeypatch.setattr(parallel_state, "_groups", {**parallel_state._groups, **groups})
        reset_bytes_read()
        shard = load_model(model_config, "cpu", load_config=load_config, read_slices=True)
        assert 0.45 * file_bytes < bytes_read() < 0.55 * file_bytes, (strategy, num_threads, rank)
        rows = full.model.layers[0].mlp.gate_up_proj.weight.shape[0] // 4
        expected = full.model.layers[0].mlp.gate_up_proj.weight[rank * rows:(rank + 1) * rows]
        assert torch.equal(shard.model.layers[0].mlp.gate_up_proj.weight[:rows], expected)
        columns = full.model.layers[1].self_attn.o_proj.weight.shape[1] // 2
        assert torch.equal(shard.model.layers[1].self_attn.o_proj.weight,
                           full.model.layers[1].self_attn.o_proj.weight[:, rank * columns:(rank + 1) * columns])


def test_readers_hand_out_the_bytes_safe_open_reads(tiny_model_dir) -> None:
    folder = tiny_model_dir("qwen2", max_shard_size="40KB")
    files = safetensors_weight_files(folder)
    for strategy in STRATEGIES:
        with open_checkpoint_reader(files, strategy) as reader:
            assert reader.strategy == strategy
            names = [entry.name for entry in reader.entries]
            for entry in reader.entries:
                with safe_open(files[entry.file_index], framework="pt") as handle:
                    expected = handle.get_tensor(entry.name)
                assert torch.equal(_bits(reader.tensor(entry.name)), _bits(expected)), (strategy, entry.name)
                assert entry.num_bytes == expected.numel() * expected.element_size()
                reader.release(entry.name)
        assert sorted(names) == sorted(n for f in files for n in load_file(f))


def test_eager_reader_drops_each_file_after_its_last_tensor(tiny_model_dir) -> None:
    folder = tiny_model_dir("qwen2", max_shard_size="40KB")
    with EagerCheckpointReader(safetensors_weight_files(folder)) as reader:
        index = next(i for i in range(len(reader.files))
                     if sum(e.file_index == i for e in reader.entries) >= 2)
        first = [e for e in reader.entries if e.file_index == index]
        for entry in first[:-1]:
            reader.tensor(entry.name)
            reader.release(entry.name)
        assert list(reader._buffers) == [index]
        reader.tensor(first[-1].name)
        reader.release(first[-1].name)
        assert reader._buffers == {}


def test_prefetch_reads_the_next_shard_ahead_and_stops_its_thread(tiny_model_dir) -> None:
    folder = tiny_model_dir("qwen2", max_shard_size="40KB")
    reader = PrefetchCheckpointReader(safetensors_weight_files(folder))
    try:
        entry = next(e for e in reader.entries if e.file_index == 2)
        reader.tensor(entry.name)  # the loader starts on file 2: file 3 is read ahead
        for _ in range(500):
            if len(reader.prefetched_files) == 2:
                break
            threading.Event().wait(0.01)
        # File 0 from the start (ahead of the first read), then the file after the one being read.
        assert reader.prefetched_files == [0, 3]
    finally:
        reader.close()
    assert not reader._thread.is_alive()


def test_a_failing_thread_fails_the_load_and_releases_threads(tiny_model_dir, tmp_path) -> None:
    source = tiny_model_dir("llama")
    folder = str(tmp_path / "extra")
    shutil.copytree(source, folder)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    tensors["model.layers.1.mystery.weight"] = torch.zeros(2)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    for strategy in STRATEGIES:
        with pytest.raises(ValueError, match="'model.layers.1.mystery.weight' matches no parameter"):
            load_model(_model_config(folder), "cpu", load_config=LoadConfig(
                enable_multithread_load=True, num_threads=2, safetensors_load_strategy=strategy))
        assert _load_threads() == []


def test_truncated_file_is_reported_by_the_eager_reader(tiny_model_dir, tmp_path) -> None:
    folder = str(tmp_path / "truncated")
    shutil.copytree(tiny_model_dir("llama"), folder)
    path = os.path.join(folder, "model.safetensors")
    with open(path, "rb") as f:
        head = f.read(8 + 16)
    with open(path, "wb") as f:
        f.write(head)
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_model(_model_config(folder), "cpu", load_config=LoadConfig(safetensors_load_strategy="eager"))


@pytest.mark.parametrize("kwargs, message", [
    (dict(safetensors_load_strategy="fast"), r"safetensors_load_strategy='fast' must be one of \['lazy', 'eager'"),
    (dict(num_threads=0), r"num_threads=0 must be an integer in \[1, 256\]"),
    (dict(num_threads=2.5), r"num_threads=2.5 must be an integer"),
    (dict(enable_multithread_load="yes"), r"enable_multithread_load='yes' must be true or false"),
    (dict(weight_layout="nz"), r"weight_layout='nz' must be one of \['auto', 'plain', 'prepacked', 'plain_native', 'amx_packed'\]"),
])
def test_bad_values_are_rejected_naming_the_knob(tiny_model_dir, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.create(tiny_model_dir("llama"), max_model_len=64, num_kv_blocks=8, **kwargs)


def test_cli_flags_reach_the_load_config(tiny_model_dir) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", tiny_model_dir("llama"), "--enable-multithread-load", "--num-threads", "3",
                              "--safetensors-load-strategy", "prefetch", "--weight-layout", "plain",
                              "--max-model-len", "64", "--num-kv-blocks", "8"])
    config = EngineConfig.create(**engine_kwargs_from_args(args))
    assert config.load_config == LoadConfig(enable_multithread_load=True, num_threads=3,
                                            safetensors_load_strategy="prefetch", weight_layout="plain")
    defaults = EngineConfig.create(tiny_model_dir("llama"), max_model_len=64, num_kv_blocks=8).load_config
    assert defaults == LoadConfig() and defaults.num_load_threads == 1
