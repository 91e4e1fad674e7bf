"""benchmarks/native_guard.py: a benchmark that times the native kernels stops, naming the ISA level asked and the
cause, when the native library did not load; --allow-plain-pytorch times the fallback and records level 'none'."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from pagedserve.kernels import cpu_isa, cpu_library

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def load_native_guard() -> ModuleType:
    # By path, under its own name: putting benchmarks/ on sys.path would shadow modules (serving, moe, ...).
    spec = importlib.util.spec_from_file_location("benchmarks_native_guard", BENCHMARKS / "native_guard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


native_guard = load_native_guard()


def failing_loader() -> None:
    """load_native_extension as it fails on a broken build: a RuntimeError caused by the build's error."""
    try:
        raise OSError("c++: elementwise.cpp:12: error: expected ';'")
    except OSError as cause:
        raise RuntimeError("attention backend 'cpu_native' is unavailable") from cause


def test_a_missing_library_stops_the_benchmark_naming_the_level_asked_and_the_cause(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_library, "load_native_extension", failing_loader)
    asked = cpu_isa.selected_level()
    with pytest.raises(native_guard.NativeKernelsNotLoaded) as stopped:
        native_guard.require_native_kernels()
    message = str(stopped.value)
    assert f"ISA level asked {asked!r}" in message
    assert "OSError: c++: elementwise.cpp:12: error: expected ';'" in message
    assert native_guard.ALLOW_FLAG in message

    with pytest.raises(native_guard.NativeKernelsNotLoaded) as stopped:
        native_guard.require_native_kernels(can_time_fallback=False)  # a native-op micro-benchmark: no flag offered
    assert f"ISA level asked {asked!r}" in str(stopped.value) and native_guard.ALLOW_FLAG not in str(stopped.value)

    # Allowed on purpose: the record names the level that ran ('none'), not the one asked.
    assert native_guard.require_native_kernels(allow_plain_pytorch=True) == {
        "isa_level": "none", "isa_level_asked": asked,
        "not_loaded_reason": "OSError: c++: elementwise.cpp:12: error: expected ';'"}


@pytest.mark.skipif(not cpu_library.is_native_extension_available(),
                    reason="no native CPU kernel build here (PAGEDSERVE_CPU_ISA=none, or a CPU without one)")
def test_a_loaded_library_passes_and_records_the_level_that_runs() -> None:
    record = native_guard.require_native_kernels()
    assert record == {"isa_level": cpu_library.loaded_level(), "isa_level_asked": cpu_isa.selected_level(),
                      "not_loaded_reason": None}
    assert record["isa_level"] in cpu_isa.LEVELS[1:]


def test_a_recipe_under_cap_none_stops_before_it_measures() -> None:
    # The real loader under PAGEDSERVE_CPU_ISA=none, through a recipe's own argument parsing (it stops before it
    # builds its model).
    env = dict(os.environ, PAGEDSERVE_CPU_ISA="none", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]))
    completed = subprocess.run([sys.executable, str(BENCHMARKS / "async_scheduling.py"), "--model", "tiny"],
                               env=env, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 1, completed.stderr
    assert "ISA level asked 'none' (PAGEDSERVE_CPU_ISA=none;" in completed.stderr
    assert native_guard.ALLOW_FLAG in completed.stderr
    assert completed.stdout == ""  # nothing measured
