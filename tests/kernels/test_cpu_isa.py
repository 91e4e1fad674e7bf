"""The ISA levels, the PAGEDSERVE_CPU_ISA cap, and the flags each level's native build is compiled with."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from pagedserve.kernels import cpu_isa, cpu_library

ZEN3_FLAGS = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}
ZEN4_FLAGS = ZEN3_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16", "avx512_vnni"}
SAPPHIRE_RAPIDS_FLAGS = ZEN4_FLAGS | {"amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize("flags, levels", [
    (set(), ("none",)),
    ({"avx", "sse4_2"}, ("none",)),
    ({"avx2", "sse4_2"}, ("none",)),  # AVX2 without FMA/F16C: below x86-64-v3
    (ZEN3_FLAGS, ("none", "avx2")),
    (ZEN3_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}, ("none", "avx2", "avx512")),
    (ZEN4_FLAGS, ("none", "avx2", "avx512", "avx512_bf16")),
    (SAPPHIRE_RAPIDS_FLAGS, ("none", "avx2", "avx512", "avx512_bf16", "amx")),
    (ZEN3_FLAGS | {"avx512_bf16", "amx_tile", "amx_bf16"}, ("none", "avx2")),  # levels are cumulative
    (ZEN4_FLAGS - {"avx512_vnni"}, ("none", "avx2", "avx512")),  # the bf16 level's int8 kernels need VNNI
    (SAPPHIRE_RAPIDS_FLAGS - {"amx_int8"}, ("none", "avx2", "avx512", "avx512_bf16")),
])
def test_levels_of_flags(flags: set[str], levels: tuple[str, ...]) -> None:
    assert cpu_isa.levels_of_flags(flags) == levels


@pytest.mark.parametrize("value", ["avx3", "AVX-512", "native", "sse"])
def test_unknown_cap_names_the_value_and_the_levels(value: str) -> None:
    with pytest.raises(ValueError) as error:
        cpu_isa.parse_cap(value)
    message = str(error.value)
    assert cpu_isa.CAP_ENV in message and repr(value) in message
    assert all(level in message for level in cpu_isa.LEVELS)


@pytest.mark.parametrize("cpu, cap, expected", [
    (("none", "avx2"), None, "avx2"),
    (("none", "avx2"), "amx", "avx2"),  # a cap above the CPU changes nothing
    (("none", "avx2"), "none", "none"),
    (("none", "avx2", "avx512", "avx512_bf16", "amx"), "avx512", "avx512"),
    (("none", "avx2", "avx512", "avx512_bf16", "amx"), "AVX2", "avx2"),
    (("none", "avx2", "avx512", "avx512_bf16"), "", "avx512_bf16"),
])
def test_selected_level_is_the_lower_of_cap_and_cpu(monkeypatch: pytest.MonkeyPatch, cpu: tuple[str, ...],
                                                    cap: str | None, expected: str) -> None:
    monkeypatch.setattr(cpu_isa, "cpu_levels", lambda: cpu)
    if cap is None:
        monkeypatch.delenv(cpu_isa.CAP_ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_isa.CAP_ENV, cap)
    assert cpu_isa.selected_level() == expected


def test_unknown_cap_fails_the_engine_at_start(monkeypatch: pytest.MonkeyPatch, tiny_model_dir) -> None:
    from pagedserve.config.engine import EngineConfig

    monkeypatch.setenv(cpu_isa.CAP_ENV, "avx1024")
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_ISA='avx1024' is not an ISA level"):
        EngineConfig.create(tiny_model_dir("llama"))


def test_none_has_no_build_and_every_other_level_adds_flags() -> None:
    with pytest.raises(ValueError, match="has no native build"):
        cpu_isa.compile_flags("none")
    previous: tuple[str, ...] = ()
    for level in cpu_isa.LEVELS[1:]:
        flags = cpu_isa.compile_flags(level)
        assert flags[:len(previous)] == previous and len(flags) > len(previous)
        assert not any(flag.startswith(("-march", "-mtune=native")) for flag in flags)  # never the build machine's
        previous = flags


def test_each_level_has_its_own_build_key() -> None:
    keys = {cpu_library.extension_key(level) for level in cpu_isa.LEVELS[1:]}
    assert len(keys) == len(cpu_isa.LEVELS) - 1


# The macros a level's build may and may not see: a build never holds instructions its level's CPUs lack.
_LEVEL_MACROS = {
    "avx2": ({"__AVX2__", "__FMA__", "__F16C__"}, {"__AVX512F__", "__AVX512BF16__", "__AMX_TILE__"}),
    "avx512": ({"__AVX2__", "__AVX512F__", "__AVX512BW__", "__AVX512VL__"},
               {"__AVX512BF16__", "__AVX512VNNI__", "__AMX_TILE__"}),
    "avx512_bf16": ({"__AVX512F__", "__AVX512BF16__", "__AVX512VNNI__"}, {"__AMX_TILE__", "__AMX_BF16__"}),
    "amx": ({"__AVX512BF16__", "__AMX_TILE__", "__AMX_BF16__", "__AMX_INT8__"}, {"__AVX512FP16__"}),
}


@pytest.mark.skipif(not cpu_isa.is_x86() or shutil.which("c++") is None, reason="needs an x86-64 C++ compiler")
@pytest.mark.parametrize("level", cpu_isa.LEVELS[1:])
def test_level_flags_enable_exactly_that_level(level: str) -> None:
    output = subprocess.run(["c++", "-dM", "-E", "-x", "c++", "-", *cpu_library.compile_flags(level)], input="",
                            capture_output=True, text=True, check=True).stdout
    defined = {line.split()[1] for line in output.splitlines() if line.startswith("#define ")}
    required, forbidden = _LEVEL_MACROS[level]
    assert required <= defined, f"{level}: missing {required - defined}"
    assert not forbidden & defined, f"{level}: enables {forbidden & defined}"


def test_describe_names_the_running_level() -> None:
    assert cpu_isa.describe().startswith(cpu_isa.selected_level())
