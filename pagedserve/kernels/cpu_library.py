"""Builds, loads and dispatches the native CPU kernels (kernels/cpu/): one library of torch ops per ISA level.

Dispatch happens at start: kernels/cpu_isa.py picks the level this process runs (the CPU's best, lowered by
PAGEDSERVE_CPU_ISA), and this module builds (at first use) and loads that level's library. Every source in SOURCES
is compiled with the level's flags only (cpu_isa.compile_flags; the sources choose their code paths with
`#if defined(__AVX512F__)` and the like), so one machine's build never holds an instruction another CPU of the same
level lacks, and each level's build is cached apart. A level without a build ('none', or a CPU that is not x86-64)
loads nothing: the callers keep their plain-PyTorch paths, and the start-up log says why once.

The library is also a Python extension module (`native_module()`): a call from Python that a batch-1 decode step
makes once per token (the decode stack's decode_rows_greedy) skips torch's dispatcher there.

Sources (kernels/cpu/): paged_attention.cpp (paged decode attention, K/V write; attention/cpu_native.py),
prefill_attention.cpp, elementwise.cpp (RMSNorm, residual add + RMSNorm, rotary embedding, SiLU-and-mul;
kernels/elementwise.py), small_batch_linear.cpp and amx_linear.cpp (layers/small_batch_linear.py,
layers/amx_linear.py), gguf_linear.cpp (linears and embeddings on GGUF blocks; layers/gguf_linear.py),
decode_stack.cpp (a decode step's layers in one call; models/native_decode_stack.py) and first_argmax.cpp (greedy
sampling's argmax; sample/greedy.py). They are compiled together at first use with
torch.utils.cpp_extension (needs a C++ compiler and `ninja`) into ~/.cache/pagedserve/extensions/<key>/, where
<key> hashes every source, the level's compiler flags, the compiler and the torch/Python versions. A later start
finds the built library there and just loads it (no compiler needed). Every load marks its directory as used
(mtime); after a build the cache keeps the new build and the NUM_KEPT_BUILDS - 1 most recently used others (other
levels, versions or checkouts on the machine) and removes the rest.

`load_native_extension()` raises on failure (for callers that asked for the native backend);
`is_native_extension_available()` never raises: a failed build logs one warning and returns False (the CPU
platform then keeps the portable torch_paged backend, and the layers their plain-PyTorch forward).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from pagedserve import cache_directory
from pagedserve.kernels import cpu_isa

logger = logging.getLogger(__name__)

# The C++ sources and headers (kernels/cpu/).
SOURCE_DIR = Path(__file__).resolve().parent / "cpu"
SOURCES = ("paged_attention.cpp", "prefill_attention.cpp", "elementwise.cpp", "small_batch_linear.cpp",
           "amx_linear.cpp", "decode_stack.cpp", "first_argmax.cpp", "gguf_linear.cpp", "int8_linear.cpp")
# Headers the sources include: part of the build's key like the sources.
HEADERS = ("paged_decode_attention.h", "amx_linear.h", "amx_tiles.h", "bfloat16_rounding.h", "bfloat16_silu_table.h",
           "elementwise.h", "exp_polynomial.h", "float_vector.h", "small_batch_linear.h", "spin_barrier.h",
           "first_argmax.h", "vector_avx2.h", "gguf_linear.h", "int8_linear.h", "int8_avx512.h")
# Flags of every level's build; cpu_isa.compile_flags(level) adds the level's instruction sets.
BASE_COMPILE_FLAGS = ("-O3", "-fopenmp")
LINK_FLAGS = ("-fopenmp",)
# Overrides the cache root (tests and read-only homes).
CACHE_DIR_ENV = "PAGEDSERVE_EXTENSION_CACHE"
# Builds the cache keeps (the current one included): each source change or level makes a new key, ~2-4 MB each.
NUM_KEPT_BUILDS = 6
KEY_LENGTH = 20

class NativeKernelsUnavailable(RuntimeError):
    """No native build runs here by design (the ISA level is 'none', or the CPU has no build): not a failure."""


_lock = threading.Lock()
# None: not tried yet; True: loaded in this process; an Exception: the failure, kept so it is reported once.
_state: bool | BaseException | None = None
# The library as a Python module, once loaded.
_module: Any = None
# The level whose library this process loaded (set once, with _state).
_loaded_level: str | None = None


def compile_flags(level: str) -> tuple[str, ...]:
    return BASE_COMPILE_FLAGS + cpu_isa.compile_flags(level)


def extension_key(level: str) -> str:
    """Hash of everything `level`'s library depends on: every source, its flags, compiler, torch and Python."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode())
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(repr((level, compile_flags(level), LINK_FLAGS, os.environ.get("CXX", "c++"))).encode())
    digest.update(f"{torch.__version__} {sys.version_info[:2]}".encode())
    return digest.hexdigest()[:KEY_LENGTH]


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or os.path.join(cache_directory.cache_root(), "extensions"))


def extension_dir(level: str) -> Path:
    return cache_root() / extension_key(level)


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


def _library_name(level: str) -> str:
    # The key in the name keeps two builds from ever sharing a name inside one process.
    return f"pagedserve_cpu_kernels_{level}_{extension_key(level)}"


def _import_library(path: Path, name: str) -> Any:
    """Imports the library at `path` as the Python module it also is (loading it registers its torch ops)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the native library {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(level: str) -> tuple[Path, Any]:
    """`level`'s library path, building it when it is missing; the module too when this call built and loaded it."""
    directory = extension_dir(level)
    name = _library_name(level)
    library = directory / f"{name}.so"
    if library.exists():
        return library, None
    build_dir = directory / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_build(build_dir):
        if library.exists():  # another process built it while this one waited
            return library, None
        from torch.utils import cpp_extension

        logger.warning("building the native CPU kernels for ISA level %s into %s (once per level and source; a few "
                       "minutes)", level, directory)
        # Builds into build/, then publishes the library by an atomic rename, so a concurrent process never loads a
        # half-written file. torch's own lock file there is left behind by a builder that was killed, and makes
        # every later build wait for it forever: holding the flock, this process is the only builder, so such a
        # file is stale.
        with contextlib.suppress(FileNotFoundError):
            (build_dir / "lock").unlink()
        module = cpp_extension.load(
            name=name, sources=[str(SOURCE_DIR / source) for source in SOURCES],
            extra_cflags=list(compile_flags(level)), extra_ldflags=list(LINK_FLAGS), build_directory=str(build_dir),
            is_python_module=True, verbose=False,
        )
        temporary = directory / f"{library.name}.{os.getpid()}.tmp"
        shutil.copyfile(build_dir / library.name, temporary)
        os.replace(temporary, library)
        # build/ stays: a process that started at the same time may still be waiting to load the library from it.
        removed = prune_extension_cache(directory.parent, directory.name)
        if removed:
            logger.info("removed %d older native builds from %s", len(removed), directory.parent)
        return library, module  # cpp_extension.load already loaded the library it built


@contextlib.contextmanager
def _exclusive_build(build_dir: Path) -> Iterator[None]:
    """One builder per build directory across processes: an flock, which the kernel releases when its holder exits
    or is killed (a killed builder never blocks the next one)."""
    with open(build_dir / "builder.flock", "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _build_and_load(level: str) -> Any:
    """Loads `level`'s cached library, building it first when it is missing; returns it as a Python module."""
    library, module = _build(level)
    if module is not None:
        return module
    module = _import_library(library, _library_name(level))
    directory = library.parent
    with contextlib.suppress(OSError):  # a read-only cache still loads
        os.utime(directory)  # used now: pruning keeps the most recently used builds
    return module


def load_native_extension() -> None:
    """Makes the native ops (torch.ops.pagedserve.paged_decode_attention, cpu_rms_norm, ...) available,
    building them at first use.

    Raises RuntimeError naming the cause when the extension cannot be built or loaded.
    """
    global _state, _module, _loaded_level
    with _lock:
        if _state is None:
            try:
                level = cpu_isa.selected_level()  # ValueError for an unknown cap
                reason = cpu_isa.reason_for_no_build()
                if reason is not None:
                    raise NativeKernelsUnavailable(reason)
                _module = _build_and_load(level)
                _loaded_level = level
                _state = True
                logger.info("native CPU kernels: ISA level %s", cpu_isa.describe())
            except NativeKernelsUnavailable as error:
                _state = error
                logger.warning("native CPU kernels not used: %s", error)
            except ValueError:
                raise  # a bad PAGEDSERVE_CPU_ISA: an error at start, not a fallback
            except Exception as error:  # a missing compiler/ninja, a compile error, a bad cached file
                _state = error
                logger.warning("native CPU kernels unavailable (%s: %s); using the torch_paged attention "
                               "backend and the plain-PyTorch layers", type(error).__name__, error)
        if _state is not True:
            raise RuntimeError(f"attention backend 'cpu_native' is unavailable: the native kernels could not be "
                               f"built or loaded ({type(_state).__name__}: {_state}); install a C++ compiler "
                               f"and ninja, or use attention_backend='torch_paged'") from _state


def loaded_level() -> str | None:
    """The ISA level of the library this process loaded (None before a load, or when none loaded)."""
    return _loaded_level


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
