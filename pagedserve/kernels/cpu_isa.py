"""The CPU's instruction-set levels, the user's cap on them, and the compiler flags of each level's kernel build.

The native CPU kernels (kernels/cpu/) are built once per ISA level, each build with exactly the flags of its level
(never -march=native), so a build never holds an instruction its level's CPUs lack and a cached build can be shared
by every CPU of that level. At start the process runs the highest level that both the CPU supports and the cap
allows (kernels/cpu_library.py builds and loads that one library).

Levels, lowest first (each implies the ones before it):
- 'none': no native kernels; the layers and attention run their plain-PyTorch forms.
- 'avx2': x86-64 with AVX2, FMA and F16C (Intel since Haswell, AMD since Zen 1); bfloat16 is widened to float32
  by a shift and computed with float32 FMA.
- 'avx512': AVX-512 F/BW/VL/DQ/CD (Intel Skylake-SP and later, AMD Zen 4 and later).
- 'avx512_bf16': plus AVX512-BF16 and AVX512-VNNI dot products (VDPBF16PS, VPDPBUSD / VPDPWSSD: AMD Zen 4, Intel
  Cooper Lake and Sapphire Rapids; every CPU with AVX512-BF16 has VNNI).
- 'amx': plus AMX tiles (TDPBF16PS, and TDPB*D for int8: Intel Sapphire Rapids and later; Linux must grant the tile state, which the
  kernels ask for at run time and fall back to the dot products without).

`PAGEDSERVE_CPU_ISA` (like oneDNN's ONEDNN_MAX_CPU_ISA) caps the level: the process runs the lower of the cap and
the CPU's best level. An unknown value is a ValueError naming it and the valid ones. aarch64 has no native build
yet: its level is 'none', and the start-up log says why (the sources compile for it: tests/kernels/test_cpu_isa.py
cross-compiles them where Debian's aarch64 cross compiler is installed).
"""
from __future__ import annotations

import functools
import os
import platform

CAP_ENV = "PAGEDSERVE_CPU_ISA"
# Lowest first; a level implies every level before it.
LEVELS = ("none", "avx2", "avx512", "avx512_bf16", "amx")

# /proc/cpuinfo flags each level needs beyond the previous one (x86-64-v3 for avx2, x86-64-v4 for avx512).
_REQUIRED_FLAGS = {
    "avx2": ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"),
    "avx512_bf16": ("avx512_bf16", "avx512_vnni"),
    "amx": ("amx_tile", "amx_bf16", "amx_int8"),
}
# GCC/Clang flags each level adds to the previous one's.
_LEVEL_FLAGS = {
    "avx2": ("-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mmovbe", "-mpopcnt"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512cd"),
    "avx512_bf16": ("-mavx512bf16", "-mavx512vnni"),
    "amx": ("-mamx-tile", "-mamx-bf16", "-mamx-int8"),
}
# The flags the sources are compiled with for aarch64 (the cross-compile check; no aarch64 build runs yet).
AARCH64_FLAGS = ("-march=armv8-a",)
X86_MACHINES = ("x86_64", "amd64", "i686", "i386")


def is_x86() -> bool:
    return platform.machine().lower() in X86_MACHINES


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def levels_of_flags(flags: frozenset[str] | set[str]) -> tuple[str, ...]:
    """The levels a CPU with these /proc/cpuinfo flags supports, lowest first ('none' always)."""
    supported = ["none"]
    for level in LEVELS[1:]:
        if not all(flag in flags for flag in _REQUIRED_FLAGS[level]):
            break
        supported.append(level)
    return tuple(supported)


@functools.cache
def cpu_levels() -> tuple[str, ...]:
    """The levels this CPU supports, lowest first ('none' only off x86-64)."""
    return levels_of_flags(_cpu_flags()) if is_x86() else ("none",)


def best_cpu_level() -> str:
    return cpu_levels()[-1]


def parse_cap(value: str | None) -> str | None:
    """The cap a PAGEDSERVE_CPU_ISA value names (None for unset or empty); ValueError for an unknown value."""
    if value is None or value.strip() == "":
        return None
    cap = value.strip().lower()
    if cap not in LEVELS:
        raise ValueError(f"{CAP_ENV}={value!r} is not an ISA level; valid levels: {', '.join(LEVELS)}")
    return cap


def cap_from_environment() -> str | None:
    return parse_cap(os.environ.get(CAP_ENV))


def selected_level() -> str:
    """The level this process runs: the CPU's best, lowered to PAGEDSERVE_CPU_ISA when that is set (a cap above
    the CPU's best changes nothing). ValueError for an unknown cap."""
    best = best_cpu_level()
    cap = cap_from_environment()
    if cap is None or LEVELS.index(cap) >= LEVELS.index(best):
        return best
    return cap


def levels_up_to(level: str) -> tuple[str, ...]:
    """Every level from 'avx2' up to `level` (the native builds a machine at `level` can run)."""
    return tuple(LEVELS[1:LEVELS.index(level) + 1])


def compile_flags(level: str) -> tuple[str, ...]:
    """The compiler flags of `level`'s build: every flag of the levels up to it ('none' has no build)."""
    if level not in LEVELS[1:]:
        raise ValueError(f"ISA level {level!r} has no native build; levels with one: {', '.join(LEVELS[1:])}")
    flags: list[str] = []
    for included in levels_up_to(level):
        flags.extend(_LEVEL_FLAGS[included])
    return tuple(flags)


def reason_for_no_build() -> str | None:
    """Why this process runs no native kernels (None when it runs a build)."""
    if not is_x86():
        return (f"no native kernel build for {platform.machine()} yet (x86-64 AVX2 and up only): the plain-PyTorch "
                f"paths run")
    level = selected_level()
    if level != "none":
        return None
    if best_cpu_level() == "none":
        return "this x86 CPU lacks AVX2/FMA/F16C, the lowest level with a native build: the plain-PyTorch paths run"
    return f"{CAP_ENV}=none: the plain-PyTorch paths run"


def describe() -> str:
    """One line for logs and `pagedserve features`: the level that runs and why."""
    cap = os.environ.get(CAP_ENV)
    try:
        level = selected_level()
    except ValueError as error:
        return str(error)
    capped = f", capped by {CAP_ENV}={cap}" if cap else ""
    return f"{level} (CPU supports {', '.join(cpu_levels())}{capped})"


__all__ = ["AARCH64_FLAGS", "CAP_ENV", "LEVELS", "best_cpu_level", "cap_from_environment", "compile_flags",
           "cpu_levels", "describe", "is_x86", "levels_of_flags", "levels_up_to", "parse_cap", "reason_for_no_build",
           "selected_level"]
