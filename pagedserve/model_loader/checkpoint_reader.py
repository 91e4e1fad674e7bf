"""CheckpointReader: a checkpoint's safetensors files opened for one `safetensors_load_strategy`.

- 'lazy' (LazyCheckpointReader): each file is memory-mapped by safetensors' `safe_open`; a tensor's
  bytes are read from storage when the loader reads that tensor (page faults on the map).
- 'eager' (EagerCheckpointReader): the first time a file is needed it is read whole into memory with a
  few large sequential reads (what network file systems serve best); tensors are zero-copy views of
  that buffer. A file's buffer is dropped once all its tensors have been handed out and consumed, so
  about one file per loading thread is held at a time.
- 'prefetch' (PrefetchCheckpointReader): lazy, plus one background thread that has the *next* shard
  files read ahead into the page cache (posix_fadvise WILLNEED in 16 MiB ranges: the kernel reads them
  without a copy to user space; a sequential read where fadvise is missing) while the current file is
  being loaded; the maps then hit the page cache instead of waiting on storage.

All three hand out the same bytes: whole tensors (`tensor`) or tensor-parallel slice sources
(`slice_source`, read through CheckpointSlice so a rank materialises only its slice). Readers are
thread-safe for different tensors and are context managers: every file handle, buffer and thread is
released on exit, on every path.
"""
from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.model_loader.checkpoint_slice import _SAFETENSORS_DTYPES

# safetensors dtype names -> torch dtypes (one table for the slices and the readers).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = _SAFETENSORS_DTYPES
# Read size of the eager reader and the prefetcher (large sequential reads).
READ_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class CheckpointEntry:
    """One tensor of the checkpoint: its name, file and size in bytes."""

    name: str
    file_index: int
    num_bytes: int


def read_safetensors_header(path: str) -> tuple[dict[str, Any], int]:
    """(header without __metadata__, byte offset where the tensor data starts) of a safetensors file."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > os.fstat(f.fileno()).st_size - 8:
            raise ValueError(f"{path}: not a safetensors file (header length {header_size} exceeds the file)")
        header = json.loads(f.read(header_size))
    header.pop("__metadata__", None)
    return header, 8 + header_size


class CheckpointReader:
    """Base: the entries of every file, in file order; subclasses read the bytes."""

    strategy = ""

    def __init__(self, files: list[str]) -> None:
        self.files = list(files)
        self.entries: list[CheckpointEntry] = []
        self._file_of: dict[str, int] = {}
        self._headers: list[dict[str, Any]] = []
        self._data_offsets: list[int] = []
        for index, path in enumerate(self.files):
            header, data_offset = read_safetensors_header(path)
            self._headers.append(header)
            self._data_offsets.append(data_offset)
            # Keys in offset order: the order they sit in the file (and safe_open's order for HF files).
            for name in sorted(header, key=lambda key: header[key]["data_offsets"][0]):
                start, end = header[name]["data_offsets"]
                self.entries.append(CheckpointEntry(name, index, end - start))
                self._file_of[name] = index
        self._closed = False

    # ---- the interface the loader uses ---------------------------------------------------------
    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor, in the file's dtype."""
        raise NotImplementedError

    def slice_source(self, name: str) -> Any:
        """A source CheckpointSlice reads from: get_shape(), get_dtype() and basic-slice indexing."""
        raise NotImplementedError

    def release(self, name: str) -> None:
        """The loader is done with tensor `name` (the eager reader frees a file after its last one)."""

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def file_index(self, name: str) -> int:
        return self._file_of[name]


class LazyCheckpointReader(CheckpointReader):
    """safe_open memory maps, one per file, opened up front and closed on exit."""

    strategy = "lazy"

    def __init__(self, files: list[str]) -> None:
        super().__init__(files)
        from safetensors import safe_open

        self._contexts: list[Any] = []
        self._handles: list[Any] = []
        try:
            for path in self.files:
                context = safe_open(path, framework="pt", device="cpu")
                self._handles.append(context.__enter__())
                self._contexts.append(context)
        except BaseException:
            self.close()
            raise

    def tensor(self, name: str) -> torch.Tensor:
        self._touch(self._file_of[name])
        return self._handles[self._file_of[name]].get_tensor(name)

    def slice_source(self, name: str) -> Any:
        self._touch(self._file_of[name])
        return self._handles[self._file_of[name]].get_slice(name)

    def _touch(self, file_index: int) -> None:
        """Hook: the loader starts on `file_index` (the prefetcher reads ahead from it)."""

    def close(self) -> None:
        contexts, self._contexts, self._handles = self._contexts, [], []
        for context in contexts:
            context.__exit__(None, None, None)
        super().close()


class _TensorSliceSource:
    """A safetensors-slice look-alike over an in-memory tensor (what CheckpointSlice reads from)."""

    def __init__(self, tensor: torch.Tensor, dtype_name: str) -> None:
        self._tensor = tensor
        self._dtype_name = dtype_name

    def get_shape(self) -> list[int]:
        return list(self._tensor.shape)

    def get_dtype(self) -> str:
        return self._dtype_name

    def __getitem__(self, key: Any) -> torch.Tensor:
        return self._tensor[key]


class EagerCheckpointReader(CheckpointReader):
    """Whole files read into memory on first use; tensors are views of the file buffer."""

    strategy = "eager"

    def __init__(self, files: list[str]) -> None:
        super().__init__(files)
        self._lock = threading.Lock()
        self._file_locks = [threading.Lock() for _ in self.files]
        self._buffers: dict[int, bytearray] = {}
        self._remaining = [0] * len(self.files)
        for entry in self.entries:
            self._remaining[entry.file_index] += 1
        self._fallback: LazyCheckpointReader | None = None  # dtypes torch.frombuffer cannot view

    def _buffer(self, file_index: int) -> bytearray:
        with self._file_locks[file_index]:  # one reader per file; other threads wait for its bytes
            buffer = self._buffers.get(file_index)
            if buffer is None:
                if self._closed:
                    raise RuntimeError("the checkpoint reader is closed")
                buffer = read_whole_file(self.files[file_index])
                self._buffers[file_index] = buffer
            return buffer

    def _view(self, name: str) -> tuple[torch.Tensor | None, str]:
        file_index = self._file_of[name]
        info = self._headers[file_index][name]
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            return None, info["dtype"]
        shape = [int(size) for size in info["shape"]]
        start, end = info["data_offsets"]
        numel = 1
        for size in shape:
            numel *= size
        if numel == 0:
            return torch.empty(shape, dtype=dtype), info["dtype"]
        buffer = self._buffer(file_index)
        # The view keeps the buffer alive until the loader has copied out of it.
        flat = torch.frombuffer(buffer, dtype=dtype, count=numel, offset=self._data_offsets[file_index] + start)
        return flat.view(shape), info["dtype"]

    def tensor(self, name: str) -> torch.Tensor:
        view, dtype_name = self._view(name)
        if view is None:
            return self._lazy_fallback().tensor(name)
        return view

    def slice_source(self, name: str) -> Any:
        view, dtype_name = self._view(name)
        if view is None:
            return self._lazy_fallback().slice_source(name)
        return _TensorSliceSource(view, dtype_name)

    def _lazy_fallback(self) -> LazyCheckpointReader:
        with self._lock:
            if self._fallback is None:
                self._fallback = LazyCheckpointReader(self.files)
            return self._fallback

    def release(self, name: str) -> None:
        file_index = self._file_of[name]
        with self._lock:
            self._remaining[file_index] -= 1
            if self._remaining[file_index] == 0:
                self._buffers.pop(file_index, None)  # live views still hold it until consumed

    def close(self) -> None:
        with self._lock:
            self._buffers.clear()
            fallback, self._fallback = self._fallback, None
        if fallback is not None:
            fallback.close()
        super().close()


def read_whole_file(path: str) -> bytearray:
    """The file's bytes, read with large sequential reads into one buffer."""
    size = os.path.getsize(path)
    buffer = bytearray(size)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < size:
            count = f.readinto(view[done:done + READ_CHUNK_BYTES])
            if not count:
                raise ValueError(f"{path}: file ended after {done} of {size} bytes while reading it")
            done += count
    view.release()
    return buffer


class PrefetchCheckpointReader(LazyCheckpointReader):
    """Lazy maps, plus a thread that reads the next `files_ahead` files into the page cache."""

    strategy = "prefetch"
    files_ahead = 1

    def __init__(self, files: list[str]) -> None:
        super().__init__(files)
        self._condition = threading.Condition()
        self._wanted: list[int] = []  # file indices to read ahead, in order
        self._queued: set[int] = set()
        self._stop = False
        self.prefetched_files: list[int] = []  # for tests and logs
        self._thread = threading.Thread(target=self._run, name="pagedserve-prefetch", daemon=True)
        self._thread.start()
        self._touch(-1)  # start on the first file(s) right away, ahead of the loader's first read

    def _touch(self, file_index: int) -> None:
        with self._condition:
            if file_index in self._queued and all(i in self._queued for i in self._ahead_of(file_index)):
                return
            self._queued.add(file_index)  # the loader reads this one itself now
            for index in self._ahead_of(file_index):
                if index not in self._queued:
                    self._queued.add(index)
                    self._wanted.append(index)
            self._condition.notify()

    def _ahead_of(self, file_index: int) -> range:
        return range(file_index + 1, min(file_index + 1 + self.files_ahead, len(self.files)))

    def _run(self) -> None:
        scratch = bytearray(READ_CHUNK_BYTES)
        while True:
            with self._condition:
                while not self._wanted and not self._stop:
                    self._condition.wait()
                if self._stop:
                    return
                file_index = self._wanted.pop(0)
            self._read_ahead(self.files[file_index], scratch)
            with self._condition:
                self.prefetched_files.append(file_index)

    def _read_ahead(self, path: str, scratch: bytearray) -> None:
        try:
            with open(path, "rb", buffering=0) as f:
                if hasattr(os, "posix_fadvise"):
                    # The kernel reads the range into the page cache without copying it to user space
                    # (cheap when the file is cached already); chunked so that close() is not held up.
                    size = os.fstat(f.fileno()).st_size
                    for offset in range(0, size, READ_CHUNK_BYTES):
                        if self._stop:
                            return
                        os.posix_fadvise(f.fileno(), offset, min(READ_CHUNK_BYTES, size - offset),
                                         os.POSIX_FADV_WILLNEED)
                    return
                while not self._stop and f.readinto(scratch):
                    pass  # no fadvise on this platform: read through the file to fill the cache
        except OSError:
            pass  # read-ahead is only a hint: the maps read the bytes themselves if this fails

    def close(self) -> None:
        with self._condition:
            self._stop = True
            self._condition.notify()
        self._thread.join()
        super().close()


_READERS: dict[str, type[CheckpointReader]] = {
    "lazy": LazyCheckpointReader, "eager": EagerCheckpointReader, "prefetch": PrefetchCheckpointReader,
}


def open_checkpoint_reader(files: list[str], strategy: str = "lazy") -> CheckpointReader:
    """A reader of `files` for `strategy` ('lazy', 'eager' or 'prefetch'); use it as a context manager."""
    if strategy not in _READERS:
        raise ValueError(f"safetensors_load_strategy={strategy!r} must be one of {list(_READERS)}")
    return _READERS[strategy](files)


__all__ = ["CheckpointEntry", "CheckpointReader", "EagerCheckpointReader", "LazyCheckpointReader",
           "PrefetchCheckpointReader", "open_checkpoint_reader", "read_safetensors_header", "read_whole_file"]
