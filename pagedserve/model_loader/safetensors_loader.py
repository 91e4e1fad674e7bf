"""Streaming weights out of an HF folder's *.safetensors files, one tensor at a time."""
from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch

SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"


def safetensors_weight_files(folder: str) -> list[str]:
    """The checkpoint's safetensors files: those named by the index when the checkpoint is sharded
    (model.safetensors.index.json), else every *.safetensors in the folder, in name order."""
    if not os.path.isdir(folder):
        raise ValueError(f"model folder {folder!r} does not exist or is not a directory")
    index_path = os.path.join(folder, SAFETENSORS_INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path}: expected a non-empty 'weight_map' object")
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
        missing = [path for path in files if not os.path.isfile(path)]
        if missing:
            raise ValueError(f"{index_path} names shard files that are missing: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"model folder {folder!r} has no *.safetensors files; expected model.safetensors or "
                         f"sharded model-XXXXX-of-XXXXX.safetensors with {SAFETENSORS_INDEX_FILE}")
    return files


def iterate_safetensors_weights(folder: str, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint in `folder`, converted to `dtype` when
    given (floating-point tensors only). Files are memory-mapped, so only one tensor is materialised at
    a time."""
    from safetensors import safe_open

    for path in safetensors_weight_files(folder):
        with safe_open(path, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                yield name, tensor
