"""The dequantized-weight cache: location, atomic publication, transparent rebuild of bad entries."""
from __future__ import annotations

import glob
import json
import os
import struct
import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from test_gguf_tiny_files import write_tiny_gguf

from pagedserve.model_loader import gguf_cache, gguf_loader
from pagedserve.model_loader.gguf_cache import (CACHE_FORMAT_VERSION, METADATA_FORMAT_VERSION, MetadataCache,
                                                WeightCache, cache_root)
from pagedserve.model_loader.gguf_loader import load_gguf


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> str:
    folder = os.path.join(tmp_path, "cache")
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", folder)
    return folder


@pytest.fixture
def tiny_path(tmp_path) -> str:
    path = os.path.join(tmp_path, "tiny.gguf")
    write_tiny_gguf(path, "llama", GGMLQuantizationType.Q4_0, with_output=True)
    return path


@pytest.fixture
def reference_weights(tiny_path: str) -> dict[str, torch.Tensor]:
    return dict(load_gguf(tiny_path, use_cache=False).weights(torch.float32))


def _forbid_parsing_and_dequantizing(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("a warm load must not parse or dequantize the GGUF file")

    monkeypatch.setattr(gguf_loader, "_open_reader", fail)
    monkeypatch.setattr(gguf_loader.gguf_dequant, "dequantize", fail)


def _cache_files(folder: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "gguf", "*"))
                  + glob.glob(os.path.join(folder, "gguf", ".*")))


def test_cache_root_precedence(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("PAGEDSERVE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == os.path.join(str(tmp_path), ".cache", "pagedserve")
    monkeypatch.setenv("XDG_CACHE_HOME", os.path.join(tmp_path, "xdg"))
    assert cache_root() == os.path.join(str(tmp_path), "xdg", "pagedserve")
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", os.path.join(tmp_path, "explicit"))
    assert cache_root() == os.path.join(str(tmp_path), "explicit")


def test_cold_then_warm_load(cache_dir, tiny_path, reference_weights, monkeypatch) -> None:
    cold = load_gguf(tiny_path)
    assert {name: tensor for name, tensor in cold.weights()}.keys() == reference_weights.keys()
    files = _cache_files(cache_dir)
    assert len(files) == 2 and files[0].endswith("-float32.safetensors") and files[1].endswith(".metadata.json")

    _forbid_parsing_and_dequantizing(monkeypatch)
    warm = load_gguf(tiny_path)
    assert warm.hf_config.to_dict() == cold.hf_config.to_dict()
    assert warm.tokenizer("hello world").input_ids == cold.tokenizer("hello world").input_ids
    warm_weights = list(warm.weights())
    assert [name for name, _ in warm_weights] == list(reference_weights)
    for name, tensor in warm_weights:
        assert torch.equal(tensor, reference_weights[name]), name


def test_dtype_gets_its_own_entry(cache_dir, tiny_path, reference_weights) -> None:
    model = load_gguf(tiny_path, torch.bfloat16)
    first = dict(model.weights())
    second = dict(model.weights())
    assert any(name.endswith("-bfloat16.safetensors") for name in _cache_files(cache_dir))
    for name, tensor in reference_weights.items():
        assert first[name].dtype == second[name].dtype == torch.bfloat16
        assert torch.equal(first[name], tensor.to(torch.bfloat16)) and torch.equal(second[name], first[name])


def test_write_is_atomic_and_an_abandoned_stream_leaves_nothing(cache_dir, tiny_path) -> None:
    model = load_gguf(tiny_path)
    final_path = WeightCache(tiny_path, torch.float32, model.weight_layout()).path
    stream = model.weights()
    next(stream)
    next(stream)
    # Mid-stream: only a temporary file exists; the final name is not visible yet.
    assert not os.path.exists(final_path)
    temporaries = [name for name in _cache_files(cache_dir) if name.endswith(".tmp")]
    assert len(temporaries) == 1 and temporaries[0].startswith(".")
    stream.close()  # the consumer gives up
    assert not os.path.exists(final_path)
    assert not [name for name in _cache_files(cache_dir) if name.endswith(".tmp")]
    # A complete pass publishes the file.
    for _ in model.weights():
        assert not os.path.exists(final_path)
    assert os.path.exists(final_path)


def _rewrite_metadata_version(path: str, version: str) -> None:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        data = f.read()
    header["__metadata__"]["format_version"] = version
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "old_version", "huge_header"])
def test_bad_cache_file_is_rebuilt(cache_dir, tiny_path, reference_weights, damage: str) -> None:
    model = load_gguf(tiny_path)
    list(model.weights())
    path = WeightCache(tiny_path, torch.float32, model.weight_layout()).path
    size = os.path.getsize(path)
    if damage == "garbage":
        with open(path, "wb") as f:
            f.write(os.urandom(size))
    elif damage == "truncated":
        os.truncate(path, size - 1000)
    elif damage == "empty":
        os.truncate(path, 0)
    elif damage == "old_version":
        _rewrite_metadata_version(path, str(CACHE_FORMAT_VERSION - 1))
    else:
        with open(path, "r+b") as f:
            f.write(struct.pack("<Q", 1 << 62))
    assert not WeightCache(tiny_path, torch.float32, model.weight_layout()).is_valid()
    rebuilt = dict(load_gguf(tiny_path).weights())
    for name, tensor in reference_weights.items():
        assert torch.equal(rebuilt[name], tensor), name
    assert os.path.getsize(path) == size
    assert WeightCache(tiny_path, torch.float32, model.weight_layout()).is_valid()


@pytest.mark.parametrize("damage", ["garbage", "old_version", "wrong_shape"])
def test_bad_metadata_entry_is_rebuilt(cache_dir, tiny_path, damage: str) -> None:
    expected = load_gguf(tiny_path).hf_config.to_dict()
    entry = MetadataCache(tiny_path)
    if damage == "garbage":
        with open(entry.path, "wb") as f:
            f.write(b"{not json")
    elif damage == "old_version":
        with open(entry.path) as f:
            document = json.load(f)
        document["format_version"] = METADATA_FORMAT_VERSION - 1
        with open(entry.path, "w") as f:
            json.dump(document, f)
    else:
        with open(entry.path, "w") as f:
            json.dump({"format_version": METADATA_FORMAT_VERSION, "metadata": [1, 2]}, f)
    assert entry.read() is None
    assert load_gguf(tiny_path).hf_config.to_dict() == expected
    assert entry.read() is not None


def test_warm_load_reads_the_payloads_at_the_recorded_offsets(cache_dir, tiny_path, monkeypatch) -> None:
    """The kept-quantized stream (and any weights the cache lacks) read the file at the table's offsets: a warm start
    never runs gguf's header parser, and the bytes are the reader's."""
    load_gguf(tiny_path)  # cold: parses and records the table
    reader_bytes = {tensor.name: np.asarray(tensor.data).tobytes()
                    for tensor in gguf_loader._open_reader(tiny_path).tensors}
    monkeypatch.setattr(gguf_loader, "_open_reader", lambda *args: pytest.fail("a warm load parsed the header"))
    warm = load_gguf(tiny_path)
    payloads = {tensor.name: payload.tobytes() for _, tensor, payload in warm._named_payloads()}
    assert payloads and payloads == {name: data for name, data in reader_bytes.items() if name in payloads}


def test_an_entry_of_the_format_before_payload_offsets_is_rewritten(cache_dir, tiny_path) -> None:
    expected = load_gguf(tiny_path).tensors
    entry = MetadataCache(tiny_path)
    with open(entry.path) as f:
        document = json.load(f)
    # The entry as the previous format wrote it: version 1, rows without the offset.
    document["format_version"] = 1
    document["tensors"] = [row[:3] for row in document["tensors"]]
    with open(entry.path, "w") as f:
        json.dump(document, f)
    assert entry.read() is None
    assert load_gguf(tiny_path).tensors == expected
    assert all(len(row) == 4 for row in entry.read()[1])


def test_changed_source_gets_a_new_entry(cache_dir, tmp_path) -> None:
    path = os.path.join(tmp_path, "model.gguf")
    write_tiny_gguf(path, seed=1)
    first = dict(load_gguf(path).weights())
    write_tiny_gguf(path, seed=2)
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same size; make the rewrite visible
    second = dict(load_gguf(path).weights())
    assert not torch.equal(first["model.embed_tokens.weight"], second["model.embed_tokens.weight"])
    assert len([name for name in _cache_files(cache_dir) if name.endswith(".safetensors")]) == 2


def test_unwritable_cache_folder_still_loads(tmp_path, tiny_path, reference_weights, monkeypatch) -> None:
    blocker = os.path.join(tmp_path, "a-file")
    with open(blocker, "w") as f:
        f.write("not a folder")
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", os.path.join(blocker, "cache"))
    weights = dict(load_gguf(tiny_path).weights())
    assert weights.keys() == reference_weights.keys()


def test_fingerprint_depends_on_content(tmp_path) -> None:
    first, second = os.path.join(tmp_path, "a"), os.path.join(tmp_path, "b")
    with open(first, "wb") as f:
        f.write(b"x" * 1000)
    with open(second, "wb") as f:
        f.write(b"x" * 999 + b"y")
    assert gguf_cache.source_fingerprint(first) != gguf_cache.source_fingerprint(second)
    assert gguf_cache.source_fingerprint(first) == gguf_cache.source_fingerprint(first)


def test_fingerprint_is_recorded_and_rechecked_by_stat(cache_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(gguf_cache, "_RECORDED_FINGERPRINT_MIN_BYTES", 0)
    path = os.path.join(tmp_path, "model.gguf")
    with open(path, "wb") as f:
        f.write(b"x" * 1000)
    first = gguf_cache.source_fingerprint(path)
    assert os.path.isfile(os.path.join(cache_dir, "fingerprints.json"))

    def no_hashing(*args, **kwargs):
        raise AssertionError("a recorded fingerprint must not hash the file again")

    monkeypatch.setattr(gguf_cache, "_fingerprint_memo", {})  # a new process
    with monkeypatch.context() as patch:
        patch.setattr(gguf_cache.hashlib, "sha256", no_hashing)
        assert gguf_cache.source_fingerprint(path) == first
    # Same size, same mtime, other content: the ctime moved, so the file is hashed again.
    stat = os.stat(path)
    time.sleep(0.05)
    with open(path, "r+b") as f:
        f.write(b"y")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    monkeypatch.setattr(gguf_cache, "_fingerprint_memo", {})
    assert gguf_cache.source_fingerprint(path) != first


def test_small_files_are_not_recorded(cache_dir, tmp_path) -> None:
    path = os.path.join(tmp_path, "small.gguf")
    with open(path, "wb") as f:
        f.write(b"x" * 1000)
    gguf_cache.source_fingerprint(path)
    assert not os.path.exists(os.path.join(cache_dir, "fingerprints.json"))
