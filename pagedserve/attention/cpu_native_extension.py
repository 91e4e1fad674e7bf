"""Builds and loads the native CPU kernels as torch ops: one library from every source in SOURCES.

The library is also a Python extension module (`native_module()`): a call from Python that a batch-1 decode step
makes once per token (the decode stack's decode_rows_greedy) skips torch's dispatcher there.

Sources (paths relative to the `pagedserve` package root): attention/native/paged_attention.cpp (paged decode
attention, K/V write; used by attention/cpu_native.py) and layers/native/elementwise.cpp (RMSNorm, residual add
+ RMSNorm, rotary embedding, SiLU-and-mul; used through layers/native_elementwise.py), the prefill attention
and linear kernels, and models/native/decode_stack.cpp (a decode step's layers in one call, driving the others
through the dispatcher; models/native_decode_stack.py), and sample/native/first_argmax.cpp (greedy sampling's
argmax; sample/greedy.py). They are compiled
together at first use with torch.utils.cpp_extension (needs a C++ compiler and `ninja`) into
~/.cache/pagedserve/extensions/<key>/, where <key> hashes every source, the compiler flags, the CPU's
flags and the torch/Python versions: `-march=native` is safe because a build is only reused on the same
kind of CPU. A later start finds the built library there and just loads it (no compiler needed). Every load marks
its directory as used (mtime); after a build the cache keeps the new build and the NUM_KEPT_BUILDS - 1 most
recently used others (other versions or checkouts on the machine) and removes the rest.

`load_native_extension()` raises on failure (for callers that asked for the native backend);
`is_native_extension_available()` never raises: a failed build logs one warning and returns False (the CPU
platform then keeps the portable torch_paged backend, and the layers their plain-PyTorch forward).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import platform as python_platform
import shutil
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

# Root of the `pagedserve` package: SOURCES are relative to it (they live next to the code that uses them).
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("attention/native/paged_attention.cpp", "attention/native/prefill_attention.cpp",
           "layers/native/elementwise.cpp", "layers/native/small_batch_linear.cpp", "layers/native/amx_linear.cpp",
           "models/native/decode_stack.cpp", "sample/native/first_argmax.cpp")
# Headers the sources include: part of the build's key like the sources.
HEADERS = ("attention/native/paged_decode_attention.h", "layers/native/amx_linear.h", "layers/native/amx_tiles.h",
           "layers/native/bfloat16_rounding.h", "layers/native/bfloat16_silu_table.h", "layers/native/elementwise.h",
           "layers/native/exp_polynomial.h", "layers/native/small_batch_linear.h", "models/native/spin_barrier.h",
           "sample/native/first_argmax.h")
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp")
LINK_FLAGS = ("-fopenmp",)
# Overrides the cache root (tests and read-only homes).
CACHE_DIR_ENV = "PAGEDSERVE_EXTENSION_CACHE"
# Builds the cache keeps (the current one included): each source change makes a new key, ~2-4 MB each.
NUM_KEPT_BUILDS = 4
KEY_LENGTH = 20

_lock = threading.Lock()
# None: not tried yet; True: loaded in this process; an Exception: the failure, kept so it is reported once.
_state: bool | BaseException | None = None
# The library as a Python module, once loaded.
_module: Any = None


def _cpu_description() -> str:
    """The CPU's model and feature flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        model = next((line for line in lines if line.startswith("model name")), "")
        flags = next((line for line in lines if line.startswith(("flags", "Features"))), "")
        return f"{model}\n{flags}"
    except OSError:
        return f"{python_platform.machine()} {python_platform.processor()}"


def extension_key() -> str:
    """Hash of everything the built library depends on: every source, flags, CPU, compiler, torch and Python."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode())
        digest.update((PACKAGE_ROOT / name).read_bytes())
    digest.update(repr((COMPILE_FLAGS, LINK_FLAGS, os.environ.get("CXX", "c++"))).encode())
    digest.update(_cpu_description().encode())
    digest.update(f"{torch.__version__} {sys.version_info[:2]}".encode())
    return digest.hexdigest()[:KEY_LENGTH]


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "pagedserve",
                                                                "extensions"))


def extension_dir() -> Path:
    return cache_root() / extension_key()


def _is_build_directory(path: Path) -> bool:
    """A directory named like a key (anything else under the root is left alone)."""
    name = path.name
    return len(name) == KEY_LENGTH and all(c in "0123456789abcdef" for c in name) and path.is_dir()


def prune_extension_cache(root: Path, current: str, num_kept: int = NUM_KEPT_BUILDS) -> list[Path]:
    """Removes the builds under `root` except `current` and the num_kept - 1 most recently used others; returns
    what it removed. A process that loaded a removed library keeps it (the mapping outlives the file), and a build
    in progress elsewhere is among the most recent, so it stays."""
    others = [path for path in root.iterdir() if _is_build_directory(path) and path.name != current]
    others.sort(key=lambda path: path.stat().st_mtime, reverse=True)
    removed = others[max(0, num_kept - 1):]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _library_name() -> str:
    # The key in the name keeps two builds from ever sharing a name inside one process.
    return f"pagedserve_cpu_kernels_{extension_key()}"


def _import_library(path: Path) -> Any:
    """Imports the library at `path` as the Python module it also is (loading it registers its torch ops)."""
    spec = importlib.util.spec_from_file_location(_library_name(), path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the native library {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_and_load() -> Any:
    """Loads the cached library, building it first when it is missing; returns it as a Python module."""
    directory = extension_dir()
    library = directory / f"{_library_name()}.so"
    if not library.exists():
        from torch.utils import cpp_extension

        build_dir = directory / "build"
        build_dir.mkdir(parents=True, exist_ok=True)
        logger.info("building the native CPU kernels into %s (once per CPU and source)", directory)
        # Builds into build/ (torch's lock file there serialises concurrent builders), then publishes the
        # library by an atomic rename, so a concurrent process never loads a half-written file.
        module = cpp_extension.load(
            name=_library_name(), sources=[str(PACKAGE_ROOT / name) for name in SOURCES],
            extra_cflags=list(COMPILE_FLAGS), extra_ldflags=list(LINK_FLAGS), build_directory=str(build_dir),
            is_python_module=True, verbose=False,
        )
        temporary = directory / f"{library.name}.{os.getpid()}.tmp"
        shutil.copyfile(build_dir / library.name, temporary)
        os.replace(temporary, library)
        # build/ stays: a process that started at the same time may still be waiting to load the library from it.
        removed = prune_extension_cache(directory.parent, directory.name)
        if removed:
            logger.info("removed %d older native builds from %s", len(removed), directory.parent)
        return module  # cpp_extension.load already loaded the library it built
    module = _import_library(library)
    with contextlib.suppress(OSError):  # a read-only cache still loads
        os.utime(directory)  # used now: pruning keeps the most recently used builds
    return module


def load_native_extension() -> None:
    """Makes the native ops (torch.ops.pagedserve.paged_decode_attention, cpu_rms_norm, ...) available,
    building them at first use.

    Raises RuntimeError naming the cause when the extension cannot be built or loaded.
    """
    global _state, _module
    with _lock:
        if _state is None:
            try:
                _module = _build_and_load()
                _state = True
            except Exception as error:  # a missing compiler/ninja, a compile error, a bad cached file
                _state = error
                logger.warning("native CPU kernels unavailable (%s: %s); using the torch_paged attention "
                               "backend and the plain-PyTorch layers", type(error).__name__, error)
        if _state is not True:
            raise RuntimeError(f"attention backend 'cpu_native' is unavailable: the native kernels could not be "
                               f"built or loaded ({type(_state).__name__}: {_state}); install a C++ compiler "
                               f"and ninja, or use attention_backend='torch_paged'") from _state


def native_module() -> Any:
    """The native library as a Python module (load_native_extension() first; raises as it does)."""
    load_native_extension()
    return _module


def is_native_extension_available() -> bool:
    """True when the native kernels are loaded (building them at first use); a failure is warned once."""
    try:
        load_native_extension()
    except RuntimeError:
        return False
    return True


def load_native_op(op_name: str, support_check: str, fake: Callable[..., Any]) -> Any:
    """The op `pagedserve::<op_name>` (its default overload) with `fake` registered for tracing, when the native
    library is loaded (building it at first use) and its catch-all `pagedserve::<support_check>()` says this
    build and process can run it; None otherwise."""
    if not is_native_extension_available() or not getattr(torch.ops.pagedserve, support_check)():
        return None
    torch.library.register_fake(f"pagedserve::{op_name}")(fake)
    return getattr(torch.ops.pagedserve, op_name).default
