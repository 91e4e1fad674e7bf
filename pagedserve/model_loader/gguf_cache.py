"""On-disk cache of dequantized GGUF weights, stored as one safetensors file per (source, dtype).

Dequantizing a GGUF file costs seconds; reading the already dequantized, HF-named tensors back
costs a fraction of that. The cache file lives under the user cache directory
($PAGEDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pagedserve, else ~/.cache/pagedserve) in `gguf/`.

Invariants:
- The file name is derived from the source's content fingerprint and the dtype; the safetensors
  metadata repeats both plus CACHE_FORMAT_VERSION. A file whose metadata, tensor names, shapes,
  dtypes or size disagree with what the loader expects is ignored and rebuilt (so a format bump,
  a truncated file or garbage all self-heal).
- Writing goes to a temporary file in the same folder, is fsync'ed, then `os.replace`d onto the
  final name: readers see either no file or a complete one, and concurrent writers each produce a
  complete file (the last rename wins).
- The cache is only an accelerator: when the folder is not writable, loading proceeds uncached.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from pagedserve.cache_directory import cache_root

logger = logging.getLogger(__name__)

# Bump when the cached content for the same source and dtype changes (name mapping, permutation,
# dequantization fixes, file layout).
CACHE_FORMAT_VERSION = 1
# The metadata entry's own version (2: tensor rows carry their payload offset). An entry of another version reads
# as missing, so releases before and after a change each re-parse the header once instead of misreading it.
METADATA_FORMAT_VERSION = 2

# Files up to this size are hashed in full (SHA-256 runs at ~1 GB/s); bigger files are keyed by
# size, mtime and a sample of their content, so a multi-GB model does not pay seconds per start.
_FULL_HASH_LIMIT_BYTES = 1 << 30
_SAMPLE_CHUNK_BYTES = 1 << 20
_NUM_SAMPLE_CHUNKS = 64
_READ_CHUNK_BYTES = 8 << 20
# Sanity bound on a safetensors JSON header; anything larger is treated as garbage.
_MAX_HEADER_BYTES = 64 << 20

_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
}

_fingerprint_memo: dict[tuple[str, int, int], str] = {}
# Files this big get their fingerprint recorded across processes (smaller ones hash in a few ms).
_RECORDED_FINGERPRINT_MIN_BYTES = 16 << 20
_NUM_FINGERPRINT_RECORDS = 64


def _stat_identity(stat: os.stat_result) -> list[int]:
    """What changes whenever a file's content may have: any write or replacement changes its ctime (which
    no tool can set back) or its inode."""
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def _fingerprint_records_path() -> str:
    return os.path.join(cache_root(), "fingerprints.json")


def _read_fingerprint_records() -> dict[str, Any]:
    try:
        with open(_fingerprint_records_path(), "rb") as f:
            records = json.load(f)
        if isinstance(records, dict) and records.get("format_version") == CACHE_FORMAT_VERSION and \
                isinstance(records.get("files"), dict):
            return records["files"]
    except (OSError, ValueError, UnicodeDecodeError):
        pass
    return {}


def _recorded_fingerprint(path: str, identity: list[int]) -> str | None:
    record = _read_fingerprint_records().get(path)
    if isinstance(record, dict) and record.get("stat") == identity and isinstance(record.get("fingerprint"), str):
        return record["fingerprint"]
    return None


def _record_fingerprint(path: str, identity: list[int], fingerprint: str) -> None:
    """Adds `path`'s record to the records file (the most recent _NUM_FINGERPRINT_RECORDS are kept; concurrent
    writers may drop each other's record, which only costs a hash at the next start)."""
    files = _read_fingerprint_records()
    files.pop(path, None)
    files[path] = {"stat": identity, "fingerprint": fingerprint}
    kept = dict(list(files.items())[-_NUM_FINGERPRINT_RECORDS:])
    try:
        _write_atomically(_fingerprint_records_path(),
                          json.dumps({"format_version": CACHE_FORMAT_VERSION, "files": kept}).encode())
    except OSError as error:
        logger.debug("GGUF fingerprint records: cannot write %s (%s)", _fingerprint_records_path(), error)


def source_fingerprint(path: str) -> str:
    """A hex digest identifying the content of `path`: memoized per path, size and mtime in the process; for a
    file of at least _RECORDED_FINGERPRINT_MIN_BYTES, also recorded in the cache folder (fingerprints.json) per
    path and stat identity (device, inode, size, mtime, ctime), so a warm start does not hash the whole file
    again (~0.15 s for the default model's 98 MB on a 2-core machine)."""
    stat = os.stat(path)
    memo_key = (os.path.abspath(path), stat.st_size, stat.st_mtime_ns)
    cached = _fingerprint_memo.get(memo_key)
    if cached is not None:
        return cached
    identity = _stat_identity(stat)
    recorded = stat.st_size >= _RECORDED_FINGERPRINT_MIN_BYTES
    if recorded and (fingerprint := _recorded_fingerprint(memo_key[0], identity)) is not None:
        _fingerprint_memo[memo_key] = fingerprint
        return fingerprint
    digest = hashlib.sha256()
    digest.update(f"size={stat.st_size};".encode())
    with open(path, "rb") as f:
        if stat.st_size <= _FULL_HASH_LIMIT_BYTES:
            while chunk := f.read(_READ_CHUNK_BYTES):
                digest.update(chunk)
        else:
            digest.update(f"mtime_ns={stat.st_mtime_ns};".encode())
            stride = (stat.st_size - _SAMPLE_CHUNK_BYTES) // (_NUM_SAMPLE_CHUNKS - 1)
            for index in range(_NUM_SAMPLE_CHUNKS):
                f.seek(index * stride)
                digest.update(f.read(_SAMPLE_CHUNK_BYTES))
    fingerprint = digest.hexdigest()
    _fingerprint_memo[memo_key] = fingerprint
    if recorded and _stat_identity(os.stat(path)) == identity:  # unchanged while it was read
        _record_fingerprint(memo_key[0], identity, fingerprint)
    return fingerprint


def _dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(
            f"dtype={dtype} cannot be cached; expected one of {[str(d) for d in _SAFETENSORS_DTYPES]}"
        )
    return str(dtype).removeprefix("torch.")


def _write_atomically(path: str, data: bytes) -> None:
    """Write `data` to `path` via a fsync'ed temporary file in the same folder and os.replace."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp", delete=False)
    try:
        with handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(handle.name, path)
    except BaseException:
        try:
            os.unlink(handle.name)
        except OSError:
            pass
        raise


class MetadataCache:
    """The parsed metadata and tensor table (name, ggml type, shape, payload offset) of one GGUF source, as JSON
    (dtype independent).

    Parsing a GGUF header with gguf's reader costs seconds for a 50k-token vocabulary (it builds a
    numpy view per string); this entry lets a warm start skip it, weights included (they are read at the
    recorded offsets).
    """

    def __init__(self, source_path: str, root: str | None = None) -> None:
        self.source_path = source_path
        self.fingerprint = source_fingerprint(source_path)
        stem = os.path.splitext(os.path.basename(source_path))[0]
        self.path = os.path.join(root or os.path.join(cache_root(), "gguf"), f"{stem}-{self.fingerprint[:24]}.metadata.json")

    def read(self) -> tuple[dict[str, Any], list[list[Any]]] | None:
        """(metadata, tensor rows) from a valid entry, or None when missing, stale or corrupt."""
        try:
            with open(self.path, "rb") as f:
                stored = json.load(f)
            if (
                stored.get("format_version") != METADATA_FORMAT_VERSION
                or stored.get("source_fingerprint") != self.fingerprint
                or not isinstance(stored.get("metadata"), dict)
                or not isinstance(stored.get("tensors"), list)
            ):
                return None
            return stored["metadata"], stored["tensors"]
        except (OSError, ValueError, UnicodeDecodeError, AttributeError):
            return None

    def write(self, metadata: dict[str, Any], tensor_rows: list[list[Any]]) -> None:
        """Store the entry atomically; a failure to write only logs a warning."""
        document = {
            "format_version": METADATA_FORMAT_VERSION,
            "source_fingerprint": self.fingerprint,
            "metadata": metadata,
            "tensors": tensor_rows,
        }
        try:
            _write_atomically(self.path, json.dumps(document, ensure_ascii=False).encode("utf-8"))
        except (OSError, TypeError, ValueError) as error:
            logger.warning("GGUF metadata cache: cannot write %s (%s)", self.path, error)


class WeightCache:
    """The cache entry for one GGUF source at one dtype.

    `layout` is the exact sequence of (HF name, shape) the loader yields; a cache file matches only
    when it holds exactly these tensors at `dtype`.
    """

    def __init__(
        self,
        source_path: str,
        dtype: torch.dtype,
        layout: Sequence[tuple[str, tuple[int, ...]]],
        root: str | None = None,
    ) -> None:
        self.source_path = source_path
        self.dtype = dtype
        self.layout = [(name, tuple(int(d) for d in shape)) for name, shape in layout]
        self.fingerprint = source_fingerprint(source_path)
        stem = os.path.splitext(os.path.basename(source_path))[0]
        self.path = os.path.join(
            root or os.path.join(cache_root(), "gguf"),
            f"{stem}-{self.fingerprint[:24]}-{_dtype_name(dtype)}.safetensors",
        )

    def _metadata(self) -> dict[str, str]:
        return {
            "format_version": str(CACHE_FORMAT_VERSION),
            "source_fingerprint": self.fingerprint,
            "source_name": os.path.basename(self.source_path),
            "dtype": _dtype_name(self.dtype),
        }

    def _header(self) -> tuple[bytes, int]:
        """The safetensors header (length prefix + JSON padded to 8 bytes) and the data size."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        entries: dict[str, object] = {"__metadata__": self._metadata()}
        offset = 0
        for name, shape in self.layout:
            num_bytes = itemsize
            for dim in shape:
                num_bytes *= dim
            entries[name] = {
                "dtype": _SAFETENSORS_DTYPES[self.dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + num_bytes],
            }
            offset += num_bytes
        text = json.dumps(entries, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text, offset

    def is_valid(self) -> bool:
        """True when the cache file exists and holds exactly the expected tensors (cheap: header only)."""
        try:
            file_size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                prefix = f.read(8)
                if len(prefix) != 8:
                    return False
                (header_length,) = struct.unpack("<Q", prefix)
                if header_length > _MAX_HEADER_BYTES or header_length + 8 > file_size:
                    return False
                stored = json.loads(f.read(header_length))
        except (OSError, ValueError, UnicodeDecodeError):
            return False
        expected_header, data_size = self._header()
        expected = json.loads(expected_header[8:])
        # Same metadata (version, fingerprint, dtype), same names/shapes/offsets, nothing missing.
        return stored == expected and file_size == 8 + header_length + data_size

    def read(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the cached tensors in layout order. Call only after `is_valid()`."""
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as f:
            for name, _ in self.layout:
                yield name, f.get_tensor(name)

    def write_through(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `weights` unchanged while writing them to the cache; publish only when complete.

        The tensors must arrive in layout order with layout shapes and this cache's dtype. If the
        consumer stops early or anything fails, the partial file is removed and nothing is published.
        """
        folder = os.path.dirname(self.path)
        try:
            os.makedirs(folder, exist_ok=True)
            handle = tempfile.NamedTemporaryFile(
                dir=folder, prefix=f".{os.path.basename(self.path)}.", suffix=".tmp", delete=False
            )
        except OSError as error:
            logger.warning("GGUF weight cache disabled: cannot write to %s (%s)", folder, error)
            yield from weights
            return
        published = False
        writing = True
        try:
            with handle:
                expected = iter(self.layout)
                try:
                    handle.write(self._header()[0])
                except OSError as error:
                    writing = self._give_up_writing(error)
                for name, tensor in weights:
                    expected_name, expected_shape = next(expected, (None, None))
                    if name != expected_name or tuple(tensor.shape) != expected_shape or tensor.dtype != self.dtype:
                        raise ValueError(
                            f"weight cache for {self.source_path}: got {name} {tuple(tensor.shape)} {tensor.dtype}, "
                            f"expected {expected_name} {expected_shape} {self.dtype}"
                        )
                    if writing:
                        try:
                            handle.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
                        except OSError as error:  # disk full, quota...: keep loading, stop caching
                            writing = self._give_up_writing(error)
                    yield name, tensor
                if next(expected, None) is not None:
                    raise ValueError(f"weight cache for {self.source_path}: the weight stream ended early")
                if writing:
                    handle.flush()
                    os.fsync(handle.fileno())
            if writing:
                os.replace(handle.name, self.path)
                published = True
        finally:
            if not published:
                try:
                    os.unlink(handle.name)
                except OSError:
                    pass

    def _give_up_writing(self, error: OSError) -> bool:
        logger.warning("GGUF weight cache: cannot write %s (%s); loading without caching", self.path, error)
        return False
