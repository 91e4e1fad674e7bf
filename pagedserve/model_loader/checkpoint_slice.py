"""Lazy safetensors tensors: each rank reads only the slice its weight loader keeps.

`iterate_safetensors_slices` yields (name, CheckpointSlice) instead of whole tensors. A CheckpointSlice
knows its shape and dtype from the file header; `narrow` and basic slicing return narrower views
without reading anything; bytes are read (through safetensors' `get_slice`, a memory map) only when the
slice meets a torch operation — in practice the loader's `param.copy_(slice)` — thanks to
`__torch_function__`. The weight loaders of the parallel layers therefore work unchanged and a
tensor-parallel rank never materialises a full tensor it keeps only part of.

`bytes_read()` counts the bytes materialised in this process (tests assert the per-rank saving).
"""
from __future__ import annotations

import threading
from typing import Any, Iterator

import torch

from pagedserve.model_loader.safetensors_loader import safetensors_weight_files

_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}

_bytes_read = 0
_bytes_read_lock = threading.Lock()  # multithreaded loading materialises slices from several threads


def bytes_read() -> int:
    """Bytes of checkpoint data materialised through CheckpointSlice in this process."""
    return _bytes_read


def reset_bytes_read() -> None:
    global _bytes_read
    _bytes_read = 0


class CheckpointSlice:
    """A not-yet-read box [start, end) per dimension of one checkpoint tensor."""

    def __init__(self, source: Any, name: str, ranges: list[tuple[int, int]], file_dtype: torch.dtype,
                 target_dtype: torch.dtype | None) -> None:
        self._source = source  # safetensors PySafeSlice; valid while its file is open
        self.name = name
        self._ranges = ranges
        self._file_dtype = file_dtype
        self._target_dtype = target_dtype

    # ---- tensor-like metadata ------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size(end - start for start, end in self._ranges)

    @property
    def dtype(self) -> torch.dtype:
        if self._target_dtype is not None and self._file_dtype.is_floating_point:
            return self._target_dtype
        return self._file_dtype

    def dim(self) -> int:
        return len(self._ranges)

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    # ---- lazy views ----------------------------------------------------------------------------
    def narrow(self, dim: int, start: int, length: int) -> "CheckpointSlice":
        dim = dim % self.dim()
        low, high = self._ranges[dim]
        if start < 0 or length < 0 or low + start + length > high:
            raise IndexError(f"{self.name}: narrow(dim={dim}, start={start}, length={length}) is outside "
                             f"size {high - low}")
        ranges = list(self._ranges)
        ranges[dim] = (low + start, low + start + length)
        return CheckpointSlice(self._source, self.name, ranges, self._file_dtype, self._target_dtype)

    def __getitem__(self, key: Any) -> "CheckpointSlice":
        keys = key if isinstance(key, tuple) else (key,)
        if len(keys) > self.dim() or not all(isinstance(k, slice) for k in keys):
            return self.materialize()[key]  # anything fancier than basic slices: read, then index
        view = self
        for dim, item in enumerate(keys):
            start, stop, step = item.indices(view.shape[dim])
            if step != 1:
                return self.materialize()[key]
            view = view.narrow(dim, start, max(stop - start, 0))
        return view

    def to(self, dtype: torch.dtype) -> "CheckpointSlice":
        return CheckpointSlice(self._source, self.name, self._ranges, self._file_dtype, dtype)

    # ---- reading -------------------------------------------------------------------------------
    def materialize(self) -> torch.Tensor:
        global _bytes_read
        if self.dim() == 0:
            tensor = self._source[()] if self._source.get_shape() == [] else self._source[:]
        else:
            tensor = self._source[tuple(slice(start, end) for start, end in self._ranges)]
        with _bytes_read_lock:
            _bytes_read += tensor.numel() * tensor.element_size()
        if self.dtype != tensor.dtype:
            tensor = tensor.to(self.dtype)
        return tensor

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        def read(value: Any) -> Any:
            if isinstance(value, CheckpointSlice):
                return value.materialize()
            if isinstance(value, (list, tuple)):
                return type(value)(read(v) for v in value)
            return value

        return func(*read(args), **{key: read(value) for key, value in (kwargs or {}).items()})

    def __repr__(self) -> str:
        return f"CheckpointSlice({self.name!r}, ranges={self._ranges}, dtype={self.dtype})"


def iterate_safetensors_slices(folder: str, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Any]]:
    """Yield (name, CheckpointSlice) for every tensor of the checkpoint in `folder`.

    A slice must be consumed (copied into its parameter) before the next item is requested: the file
    is closed once its tensors have all been yielded.
    """
    from safetensors import safe_open

    for path in safetensors_weight_files(folder):
        with safe_open(path, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                source = handle.get_slice(name)
                file_dtype = _SAFETENSORS_DTYPES.get(source.get_dtype())
                if file_dtype is None:
                    yield name, handle.get_tensor(name)  # an exotic dtype: read whole
                    continue
                ranges = [(0, int(size)) for size in source.get_shape()]
                yield name, CheckpointSlice(source, name, ranges, file_dtype, dtype)
