"""Config snapshots: a warm GGUF load reads its config without importing the transformers config class, and every
attribute reads as on the real config."""
from __future__ import annotations

import copy
import glob
import json
import os
import pickle

import pytest
from gguf import GGMLQuantizationType
from test_gguf_tiny_files import write_tiny_gguf

from pagedserve.model_loader import hf_config_snapshot
from pagedserve.model_loader.gguf_loader import load_gguf
from pagedserve.model_loader.hf_config_snapshot import ConfigSnapshot

# Attributes pagedserve reads with getattr(config, name, default), some absent on these configs.
READ_WITH_DEFAULT = ("rope_theta", "rope_scaling", "rope_parameters", "sliding_window", "use_sliding_window",
                     "layer_types", "head_dim", "num_key_value_heads", "tie_word_embeddings", "dtype", "mlp_bias",
                     "attention_bias", "architectures", "intermediate_size", "max_position_embeddings",
                     "num_experts", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> str:
    folder = os.path.join(tmp_path, "cache")
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", folder)
    return folder


def _snapshot_files(cache_dir: str) -> list[str]:
    return glob.glob(os.path.join(cache_dir, "hf_configs", "*.json"))


@pytest.mark.parametrize(("architecture", "config_class"),
                         [("llama", "LlamaConfig"), ("qwen2", "Qwen2Config"), ("qwen3", "Qwen3Config")])
def test_warm_load_reads_a_snapshot_equal_to_the_config(cache_dir, tmp_path, architecture: str,
                                                        config_class: str) -> None:
    path = os.path.join(tmp_path, f"tiny-{architecture}.gguf")
    write_tiny_gguf(path, architecture, GGMLQuantizationType.Q8_0, with_output=True)
    real = load_gguf(path).hf_config
    assert type(real).__name__ == config_class  # first load: the real config, recorded
    assert len(_snapshot_files(cache_dir)) == 1

    snapshot = load_gguf(path).hf_config
    assert isinstance(snapshot, ConfigSnapshot)
    recorded = [name for name in vars(snapshot) if not name.startswith("__")]
    assert {"hidden_size", "num_hidden_layers", "rope_parameters", "rope_scaling", "model_type"} <= set(recorded)
    for name in recorded:
        value = getattr(snapshot, name)
        assert value == getattr(real, name) and type(value) is type(getattr(real, name)), name
    for name in READ_WITH_DEFAULT:
        assert getattr(snapshot, name, "absent") == getattr(real, name, "absent"), name
    with pytest.raises(AttributeError):
        snapshot.no_such_attribute  # noqa: B018
    assert vars(snapshot)["__config"] is None  # nothing above needed the real config
    # Anything else (a method, an unrecorded property) is read from the real config, built then.
    assert snapshot.to_dict() == real.to_dict()
    assert snapshot.num_labels == real.num_labels
    assert type(vars(snapshot)["__config"]).__name__ == config_class


def test_snapshot_pickles_and_copies(cache_dir, tmp_path) -> None:
    path = os.path.join(tmp_path, "tiny.gguf")
    write_tiny_gguf(path, "llama", GGMLQuantizationType.Q8_0)
    load_gguf(path)
    snapshot = load_gguf(path).hf_config
    for clone in (pickle.loads(pickle.dumps(snapshot)), copy.deepcopy(snapshot), copy.copy(snapshot)):
        assert isinstance(clone, ConfigSnapshot)
        assert (clone.hidden_size, clone.rope_parameters) == (snapshot.hidden_size, snapshot.rope_parameters)
        assert getattr(clone, "rope_theta", None) is None


def test_other_transformers_version_or_bad_entry_builds_the_real_config(cache_dir, tmp_path, monkeypatch) -> None:
    path = os.path.join(tmp_path, "tiny.gguf")
    write_tiny_gguf(path, "llama", GGMLQuantizationType.Q8_0)
    load_gguf(path)
    [entry] = _snapshot_files(cache_dir)
    with open(entry, "w") as f:
        f.write("{not json")
    assert type(load_gguf(path).hf_config).__name__ == "LlamaConfig"  # and the entry is written again
    with open(entry) as f:
        assert json.load(f)["class"] == "LlamaConfig"
    assert isinstance(load_gguf(path).hf_config, ConfigSnapshot)

    real_version = hf_config_snapshot._transformers_version()
    monkeypatch.setattr(hf_config_snapshot, "_transformers_version", lambda: real_version + ".other")
    assert type(load_gguf(path).hf_config).__name__ == "LlamaConfig"
    assert len(_snapshot_files(cache_dir)) == 2  # one entry per version


def test_uncached_load_and_unwritable_cache_use_the_real_config(tmp_path, monkeypatch) -> None:
    path = os.path.join(tmp_path, "tiny.gguf")
    write_tiny_gguf(path, "llama", GGMLQuantizationType.Q8_0)
    blocker = os.path.join(tmp_path, "blocker")
    with open(blocker, "w") as f:
        f.write("not a folder")
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", os.path.join(blocker, "cache"))
    for _ in range(2):
        assert type(load_gguf(path).hf_config).__name__ == "LlamaConfig"
    assert type(load_gguf(path, use_cache=False).hf_config).__name__ == "LlamaConfig"


def test_json_exactness() -> None:
    exact = hf_config_snapshot._is_json_exact
    assert exact({"a": [1, 2.5, None, True, "x"], "b": {"c": 1e-6}})
    assert not exact({0: "LABEL_0"})  # int keys come back as strings
    assert not exact((1, 2))  # a tuple comes back as a list
    assert not exact(float("nan")) and not exact({"a": {1, 2}})
