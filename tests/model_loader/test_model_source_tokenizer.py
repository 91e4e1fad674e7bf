"""ModelSource's tokenizer: the one a GGUF file ships is built on first use, once."""
from __future__ import annotations

import os

from gguf import GGMLQuantizationType
from test_gguf_tiny_files import write_tiny_gguf

from pagedserve.model_loader import gguf_loader
from pagedserve.model_loader.model_source import ModelSource, _open_gguf_file


def _source(builder) -> ModelSource:  # type: ignore[no-untyped-def]
    return ModelSource(path="model.gguf", hf_config=None, tokenizer_path="model.gguf", kind="gguf",
                       tokenizer_builder=builder)


def test_built_once_on_first_use() -> None:
    calls = []
    source = _source(lambda: calls.append(1) or object())
    assert not calls
    first = source.load_tokenizer()
    assert source.load_tokenizer() is first and source.load_tokenizer("model.gguf") is first and calls == [1]


def test_gguf_source_builds_its_tokenizer_only_when_asked(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", os.path.join(tmp_path, "cache"))
    path = os.path.join(tmp_path, "tiny.gguf")
    write_tiny_gguf(path, "llama", GGMLQuantizationType.Q8_0)
    built = []
    real_build = gguf_loader.GGUFModel.tokenizer.func

    def counting_build(self):  # type: ignore[no-untyped-def]
        built.append(self.path)
        return real_build(self)

    monkeypatch.setattr(gguf_loader.GGUFModel, "tokenizer", property(counting_build))
    source = _open_gguf_file.__wrapped__(path)
    assert not built
    tokenizer = source.load_tokenizer()
    assert built == [path] and tokenizer("hello").input_ids == tokenizer.encode("hello")
    assert source.load_tokenizer() is tokenizer and built == [path]
