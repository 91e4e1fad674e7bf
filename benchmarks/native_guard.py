"""The native-kernel guard of the benchmark recipes: a recipe that times pagedserve's native CPU kernels stops when
they did not load, instead of timing the plain-PyTorch fallback unnoticed.

pagedserve falls back to its plain-PyTorch paths, with one warning line, when the native library does not build or
load (a compile error while sources are being edited, no compiler, PAGEDSERVE_CPU_ISA=none, a CPU without a build).
That is right for serving and wrong for a benchmark: its numbers would silently measure another code path. So a
recipe that runs the engine or the native ops calls, right after parsing its arguments,

    parser = argparse.ArgumentParser(...)
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_kernels = native_guard.require_native_kernels(args.allow_plain_pytorch)

and files `native_kernels` (the ISA level that ran, see `require_native_kernels`) in its result file. By default a
missing library stops the run with an error naming the ISA level asked and why it did not load; `--allow-plain-pytorch`
lets a user time the fallback on purpose (the record then says 'none'). A recipe that times a native op directly has
no fallback to time: it calls `require_native_kernels(can_time_fallback=False)` and takes no flag.

The check runs in the recipe's own process. Where the engine runs in child processes (servers, per-mode children),
the parent's check stands for them: a child inherits the environment (PAGEDSERVE_CPU_ISA) and the build cache, so it
loads the same library.
"""
from __future__ import annotations

import argparse
import os

ALLOW_FLAG = "--allow-plain-pytorch"


class NativeKernelsNotLoaded(SystemExit):
    """The native CPU kernels did not load where a benchmark expects them (SystemExit: the recipe stops with this
    message and exit status 1, no traceback)."""


def add_allow_plain_pytorch_argument(parser: argparse.ArgumentParser) -> None:
    """Adds `--allow-plain-pytorch` (args.allow_plain_pytorch) to a recipe's parser."""
    parser.add_argument(ALLOW_FLAG, action="store_true",
                        help="run even when pagedserve's native CPU kernels did not load, timing the plain-PyTorch "
                             "fallback on purpose (the result records ISA level 'none'); without it such a run stops")


def require_native_kernels(allow_plain_pytorch: bool = False, can_time_fallback: bool = True) -> dict[str, str | None]:
    """Loads the native CPU kernels (building them at first use) and returns what runs, for the result file:

        {"isa_level": the level whose library this process loaded ('none' when none did),
         "isa_level_asked": the CPU's best level lowered by PAGEDSERVE_CPU_ISA,
         "not_loaded_reason": None when loaded, else why not}

    Raises NativeKernelsNotLoaded, naming the level asked and the cause, when the library did not load and
    `allow_plain_pytorch` is False. `can_time_fallback` False: the recipe times native ops directly, so the message
    offers no --allow-plain-pytorch. An unknown PAGEDSERVE_CPU_ISA is pagedserve's own ValueError either way.
    """
    # Imported here, not at the top: a recipe's parser (and --help) stays free of torch.
    from pagedserve.kernels import cpu_isa, cpu_library

    asked = cpu_isa.selected_level()  # ValueError for an unknown PAGEDSERVE_CPU_ISA
    try:
        cpu_library.load_native_extension()
    except RuntimeError as error:
        # load_native_extension's message speaks to the attention backend; the failure itself is its cause.
        cause = error.__cause__ if error.__cause__ is not None else error
        reason = f"{type(cause).__name__}: {cause}".rstrip(".")
        if not allow_plain_pytorch:
            cap = os.environ.get(cpu_isa.CAP_ENV)
            remedy = (f"This benchmark would time the plain-PyTorch fallback instead: fix the build (or the level), "
                      f"or pass {ALLOW_FLAG} to time the fallback on purpose." if can_time_fallback else
                      "This benchmark times the native kernels themselves: fix the build (or the level).")
            raise NativeKernelsNotLoaded(
                f"pagedserve's native CPU kernels did not load: ISA level asked {asked!r} ({cpu_isa.CAP_ENV}="
                f"{cap if cap else '(unset)'}; the CPU supports {', '.join(cpu_isa.cpu_levels())}); {reason}. "
                f"{remedy}") from error
        print(f"{ALLOW_FLAG}: timing the plain-PyTorch fallback (ISA level asked {asked!r}; {reason})", flush=True)
        return {"isa_level": "none", "isa_level_asked": asked, "not_loaded_reason": reason}
    return {"isa_level": cpu_library.loaded_level(), "isa_level_asked": asked, "not_loaded_reason": None}
