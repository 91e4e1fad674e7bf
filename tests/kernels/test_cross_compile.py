"""The native sources stay portable: every one compiles for aarch64 with Debian's cross compiler (g++-aarch64-linux-gnu),
where it is installed. aarch64 has no native build yet (cpu_isa.reason_for_no_build): this keeps its sources ready."""
from __future__ import annotations

import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.utils import cpp_extension

from pagedserve.kernels import cpu_isa, cpu_library

CROSS_COMPILER = "aarch64-linux-gnu-g++"
# Included by every native source (each also includes them itself: include guards make the second time free).
TORCH_HEADERS = ("ATen/ATen.h", "ATen/Parallel.h", "torch/library.h")


@pytest.mark.skipif(shutil.which(CROSS_COMPILER) is None,
                    reason=f"{CROSS_COMPILER} is not installed (Debian: apt-get install g++-aarch64-linux-gnu)")
def test_every_source_compiles_for_aarch64(tmp_path) -> None:
    includes = [f"-isystem{path}" for path in (*cpp_extension.include_paths(), sysconfig.get_paths()["include"])]
    flags = [CROSS_COMPILER, "-std=c++20", "-fopenmp", *cpu_isa.AARCH64_FLAGS, *includes,
             "-DTORCH_EXTENSION_NAME=pagedserve_cpu_kernels_aarch64", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    # The torch headers every source includes, precompiled once with the same flags (they are most of each
    # source's compile time); -Winvalid-pch reports a header the compiler could not use.
    header = tmp_path / "torch_headers.h"
    header.write_text("".join(f"#include <{name}>\n" for name in TORCH_HEADERS))
    precompiled = subprocess.run([*flags, "-x", "c++-header", str(header), "-o", f"{header}.gch"],
                                 capture_output=True, text=True, timeout=600)
    assert precompiled.returncode == 0, precompiled.stderr[-2000:]

    def compile_source(source: str) -> subprocess.CompletedProcess[str]:
        # Syntax and semantics (templates instantiated), no code generation: what a real build would reject.
        command = [*flags, "-fsyntax-only", "-include", str(header), "-Winvalid-pch", "-Werror=invalid-pch",
                   str(cpu_library.SOURCE_DIR / source)]
        return subprocess.run(command, capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(cpu_library.SOURCES, pool.map(compile_source, cpu_library.SOURCES)))
    failures = {source: result.stderr[-2000:] for source, result in results.items() if result.returncode != 0}
    assert not failures, failures
