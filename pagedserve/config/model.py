"""ModelConfig: what the engine needs to know about the served model, normalised from an HF config."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, hf_config: Any | None) -> torch.dtype:
    """Turn the user's `dtype` ('auto', a name or a torch.dtype) into a torch.dtype.

    'auto' follows the checkpoint's `torch_dtype`/`dtype`, except that float16 becomes bfloat16
    on the CPU (vLLM does the same: CPU float16 matmuls are slow and lose range).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str):
        raise ValueError(f"dtype={dtype!r} is not valid; expected 'auto', 'float32', 'bfloat16' or 'float16'")
    name = dtype.lower()
    if name == "auto":
        # transformers >= 5 names it `dtype` (reading `torch_dtype` only warns that it is deprecated).
        config_dtype = getattr(hf_config, "dtype", None) if hf_config is not None else None
        if isinstance(config_dtype, str):
            config_dtype = _DTYPE_NAMES.get(config_dtype)
        if config_dtype in (torch.bfloat16, torch.float16):
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPE_NAMES:
        raise ValueError(
            f"dtype={dtype!r} is not valid; expected one of 'auto', {sorted(set(_DTYPE_NAMES))}"
        )
    return _DTYPE_NAMES[name]


@dataclass(frozen=True)
class ModelConfig:
    """The model to serve. `model` is a local HF folder (config.json + safetensors + tokenizer files).

    `hf_config` is the transformers PretrainedConfig; `max_model_len` is resolved from it when not given.
    """

    model: str
    tokenizer: str | None = None
    dtype: torch.dtype = torch.float32
    max_model_len: int = 2048
    seed: int = 0
    hf_config: Any = field(default=None, compare=False, repr=False)
    trust_remote_code: bool = False

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        return archs[0] if archs else "<none>"

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_attention_heads(self) -> int:
        return int(self.hf_config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        return int(getattr(self.hf_config, "num_key_value_heads", None) or self.num_attention_heads)

    @property
    def head_dim(self) -> int:
        head_dim = getattr(self.hf_config, "head_dim", None)
        return int(head_dim) if head_dim else int(self.hf_config.hidden_size) // self.num_attention_heads

    @property
    def sliding_window(self) -> int | None:
        window = getattr(self.hf_config, "sliding_window", None)
        use = getattr(self.hf_config, "use_sliding_window", True)
        return int(window) if window and use is not False else None


def derived_max_model_len(hf_config: Any) -> int:
    """The longest context the checkpoint supports, from the usual HF config keys."""
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, key, None)
        if value:
            return int(value)
    return 2048


def read_config_json(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)
