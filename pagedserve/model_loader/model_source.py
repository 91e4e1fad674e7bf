"""ModelSource: where a model comes from (an HF folder today; a GGUF file plugs in here).

Resolves the user's `model` argument once, validates it with clear errors, and exposes the HF config,
the tokenizer location and a weight stream of (HF parameter name, tensor) pairs.
"""
from __future__ import annotations

import functools
import glob
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Union

import torch

logger = logging.getLogger(__name__)

# What load_model takes as weights: a stream, a function of the built model returning one, or None (the
# safetensors files of the model folder).
WeightSource = Union[Iterable[tuple[str, torch.Tensor]], Callable[[torch.nn.Module], Iterable[tuple[str, torch.Tensor]]],
                     None]


@dataclass
class ModelSource:
    path: str
    hf_config: Any
    tokenizer_path: str
    kind: str  # 'hf' | 'gguf'
    # Yields (name, tensor) pairs in HF naming for the given dtype.
    weight_stream: Callable[[torch.dtype], Iterator[tuple[str, torch.Tensor]]] | None = field(
        default=None, repr=False)
    # A GGUF file's stream that keeps the quantized blocks: given the built model and the dtype, turns the modules
    # that can keep them into quantized ones and yields their blocks (GGUFModel.quantized_weights).
    quantized_weight_stream: Callable[[torch.nn.Module, torch.dtype], Iterator[tuple[str, torch.Tensor]]] | None \
        = field(default=None, repr=False)
    # Builds the tokenizer shipped inside the model file (GGUF metadata); called once, on first use, so a
    # process that never needs it (an engine core or worker process) never pays for it. None for an HF
    # folder, whose tokenizer files load with AutoTokenizer.
    tokenizer_builder: Callable[[], Any] | None = field(default=None, repr=False)
    _built_tokenizer: Any = field(default=None, init=False, repr=False, compare=False)
    _build_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def weights(self, dtype: torch.dtype, keep_quantized: bool = False) -> WeightSource:
        """The weight stream, or None when the default safetensors loader reads `path` itself. With
        `keep_quantized`, a GGUF file whose blocks the native kernels can read gives a function of the built model
        that returns the stream keeping them (load_model calls it); otherwise every weight comes dequantized."""
        if keep_quantized and self.quantized_weight_stream is not None:
            from pagedserve.kernels import cpu_isa
            from pagedserve.layers.gguf_linear import gguf_kernels_available

            if gguf_kernels_available():
                stream = self.quantized_weight_stream
                return lambda model: stream(model, dtype)
            logger.info("GGUF weights dequantized at load: the native kernels that read the blocks are not "
                        "available (CPU ISA %s)", cpu_isa.describe())
        return None if self.weight_stream is None else self.weight_stream(dtype)

    def load_tokenizer(self, tokenizer_path: str | None = None) -> Any:
        """The tokenizer: an explicit folder wins; else the one shipped with the model (built once)."""
        if tokenizer_path is None or tokenizer_path == self.tokenizer_path:
            if self.tokenizer_builder is not None:
                with self._build_lock:
                    if self._built_tokenizer is None:
                        self._built_tokenizer = self.tokenizer_builder()
                    return self._built_tokenizer
            tokenizer_path = self.tokenizer_path
        if not os.path.isdir(tokenizer_path):
            raise ValueError(f"tokenizer={tokenizer_path!r}: no such folder")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)

    def eos_token_ids(self, tokenizer: Any) -> set[int]:
        """EOS ids from the tokenizer, the model config and generation_config.json (all of them stop)."""
        ids: set[int] = set()
        candidates = [getattr(tokenizer, "eos_token_id", None), getattr(self.hf_config, "eos_token_id", None)]
        if self.kind == "hf":
            try:
                from transformers import GenerationConfig

                candidates.append(GenerationConfig.from_pretrained(self.path, local_files_only=True).eos_token_id)
            except OSError:
                pass  # no generation_config.json
        for candidate in candidates:
            if isinstance(candidate, int):
                ids.add(candidate)
            elif isinstance(candidate, (list, tuple)):
                ids.update(int(c) for c in candidate)
        return ids


@functools.lru_cache(maxsize=4)
def open_model_source(model: str | None) -> ModelSource:
    """Open `model`: None or a short name (the embedded default), a .gguf file, or an HF folder."""
    from pagedserve.model_loader.default_model import is_short_model_name

    if model is None or (isinstance(model, str) and (model.endswith(".gguf") or is_short_model_name(model))):
        return _open_gguf_source(model)
    if not isinstance(model, str):
        raise ValueError(f"model={model!r} must be a path to an HF model folder or a .gguf file")
    if not os.path.isdir(model):
        raise ValueError(f"model={model!r}: no such folder (expected an HF model folder with config.json "
                         f"and *.safetensors, a .gguf file, or 'smollm2-135m-instruct')")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"model={model!r}: the folder has no config.json")
    if not glob.glob(os.path.join(model, "*.safetensors")):
        raise ValueError(f"model={model!r}: the folder has no *.safetensors weight files")
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model, local_files_only=True)
    return ModelSource(path=model, hf_config=hf_config, tokenizer_path=model, kind="hf")


def _open_gguf_source(model: str | None) -> ModelSource:
    from pagedserve.model_loader.default_model import resolve_model_path

    return _open_gguf_file(resolve_model_path(model))


@functools.lru_cache(maxsize=4)
def _open_gguf_file(path: str) -> ModelSource:
    """One parse per file per process, whether it was named by path, short name or default."""
    from pagedserve.model_loader.gguf_loader import load_gguf

    if not os.path.isfile(path):
        raise ValueError(f"model={path!r}: no such file")
    gguf_model = load_gguf(path)
    return ModelSource(
        path=path,
        hf_config=gguf_model.hf_config,
        tokenizer_path=path,
        kind="gguf",
        weight_stream=gguf_model.weights,
        quantized_weight_stream=gguf_model.quantized_weights,
        tokenizer_builder=lambda: gguf_model.tokenizer,
    )
