"""Loading a safetensors checkpoint into a built model: read strategy x number of threads.

`load_checkpoint(model, folder, dtype, load_config, read_slices)` opens the folder's files with the
reader of `load_config.safetensors_load_strategy` (checkpoint_reader.py) and feeds the model's own
`load_weights` — so every weight loader, fused shard and tied embedding works as with any stream.

Multithreaded loading (`enable_multithread_load`, `num_threads`): the checkpoint's tensors are cut into
`num_threads` contiguous runs of about equal bytes, never splitting one decoder layer (all shards of a
fused parameter — q/k/v, gate/up, a layer's experts — go to one thread, whose `load_weights` call then
sees them all and reports the parameter loaded), and each thread runs `model.load_weights` on its run.
A thread reads its tensors from storage (page faults of the maps, or the eager file reads), converts
them to the model dtype and copies them into their parameters; torch releases the GIL in those copies,
so runs proceed in parallel. Parameters are disjoint between runs, so the result is the same bytes
whatever the thread count (tests check bitwise).

`read_slices=True` (tensor-parallel workers) hands out CheckpointSlice objects instead of tensors: a
rank materialises only the slice its weight loader keeps, with every strategy (the eager and prefetch
strategies still read whole files from storage; that is what they are for).
"""
from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any, Callable, Iterator

import torch
from torch import nn

from pagedserve.config.load import LoadConfig
from pagedserve.model_loader.checkpoint_reader import (SAFETENSORS_DTYPES, CheckpointEntry, CheckpointReader,
                                                       open_checkpoint_reader)
from pagedserve.model_loader.checkpoint_slice import CheckpointSlice
from pagedserve.model_loader.safetensors_loader import safetensors_weight_files

logger = logging.getLogger(__name__)

# Tensors of one decoder layer stay in one thread's run (fused parameters are per layer).
_LAYER_PREFIX = re.compile(r"^(.*?\.layers\.\d+)\.")


def _unit_key(name: str) -> str:
    match = _LAYER_PREFIX.match(name)
    return match[1] if match else name


def partition_entries(entries: list[CheckpointEntry], num_parts: int) -> list[list[CheckpointEntry]]:
    """Cut `entries` (in file order) into at most `num_parts` contiguous runs of about equal bytes,
    keeping each decoder layer's tensors in one run (a layer's tensors may be spread over files)."""
    units: dict[str, list[CheckpointEntry]] = {}
    for entry in entries:
        units.setdefault(_unit_key(entry.name), []).append(entry)
    ordered = list(units.values())  # by first appearance in file order
    total = sum(entry.num_bytes for entry in entries)
    parts: list[list[CheckpointEntry]] = [[]]
    done = 0
    for unit in ordered:
        # Start the next run once this one holds its share of the bytes.
        if parts[-1] and len(parts) < num_parts and done >= total * len(parts) / num_parts:
            parts.append([])
        parts[-1].extend(unit)
        done += sum(entry.num_bytes for entry in unit)
    return [part for part in parts if part]


def _weight_stream(reader: CheckpointReader, entries: list[CheckpointEntry], model_dtype: torch.dtype | None,
                   read_slices: bool, failed: threading.Event,
                   keep_file_dtype: Callable[[str], bool] | None = None) -> Iterator[tuple[str, Any]]:
    """(name, tensor or CheckpointSlice) for `entries`; each is released once the loader asks for the next.
    Floating-point tensors are converted to `model_dtype`, except those `keep_file_dtype` names."""
    for entry in entries:
        if failed.is_set():
            return  # another thread failed: stop early, its error is the one raised
        name = entry.name
        dtype = None if keep_file_dtype is not None and keep_file_dtype(name) else model_dtype
        try:
            if read_slices:
                yield name, _checkpoint_slice(reader, name, dtype)
            else:
                tensor = reader.tensor(name)
                if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                yield name, tensor
        finally:
            reader.release(name)


def _checkpoint_slice(reader: CheckpointReader, name: str, dtype: torch.dtype | None) -> Any:
    source = reader.slice_source(name)
    file_dtype = SAFETENSORS_DTYPES.get(source.get_dtype())
    if file_dtype is None:
        return reader.tensor(name)  # an exotic dtype: read whole
    ranges = [(0, int(size)) for size in source.get_shape()]
    return CheckpointSlice(source, name, ranges, file_dtype, dtype)


def _load_runs_in_threads(model: nn.Module, reader: CheckpointReader, runs: list[list[CheckpointEntry]],
                          dtype: torch.dtype | None, read_slices: bool, failed: threading.Event,
                          keep_file_dtype: Callable[[str], bool] | None = None) -> set[str]:
    """One thread per run, each calling model.load_weights on its run; all are joined before returning,
    and the first error (by run order) is raised once they have all stopped."""
    results: list[set[str] | None] = [None] * len(runs)
    errors: list[BaseException | None] = [None] * len(runs)

    def load_run(index: int) -> None:
        try:
            results[index] = model.load_weights(_weight_stream(reader, runs[index], dtype, read_slices, failed,
                                                               keep_file_dtype))
        except BaseException as error:  # re-raised in the calling thread below
            errors[index] = error
            failed.set()  # the other runs stop at their next tensor

    threads = [threading.Thread(target=load_run, args=(index,), name=f"pagedserve-load-{index}")
               for index in range(len(runs))]
    try:
        for thread in threads:
            thread.start()
    finally:
        for thread in threads:
            if thread.ident is not None:
                thread.join()
    for error in errors:
        if error is not None:
            raise error
    loaded: set[str] = set()
    for result in results:
        loaded |= result or set()
    return loaded


def load_checkpoint(model: nn.Module, folder: str, dtype: torch.dtype | None,
                    load_config: LoadConfig | None = None, read_slices: bool = False,
                    keep_file_dtype: Callable[[str], bool] | None = None) -> set[str]:
    """Load the safetensors checkpoint in `folder` into `model`; returns the loaded parameter names
    (as `model.load_weights` does). Tensors named by `keep_file_dtype` skip the conversion to `dtype` (a
    quantized checkpoint's float32 scales: their parameters are float32 whatever the model dtype)."""
    load_config = load_config or LoadConfig()
    files = safetensors_weight_files(folder)
    num_threads = load_config.num_load_threads
    started = time.perf_counter()
    failed = threading.Event()
    with open_checkpoint_reader(files, load_config.safetensors_load_strategy) as reader:
        if num_threads == 1:
            loaded = model.load_weights(_weight_stream(reader, reader.entries, dtype, read_slices, failed,
                                                       keep_file_dtype))
        else:
            loaded = _load_runs_in_threads(model, reader, partition_entries(reader.entries, num_threads), dtype,
                                           read_slices, failed, keep_file_dtype)
    logger.info("loaded %d checkpoint tensors from %d file(s) in %.2f s (strategy %s, %d thread(s))",
                len(reader.entries), len(files), time.perf_counter() - started,
                load_config.safetensors_load_strategy, num_threads)
    return loaded


__all__ = ["load_checkpoint", "partition_entries"]
