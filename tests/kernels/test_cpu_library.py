"""Building the native library: a builder killed mid-build never blocks the next start."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch.utils import cpp_extension

from pagedserve.kernels import cpu_library


def test_a_killed_builders_lock_file_does_not_block_the_next_build(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_library.CACHE_DIR_ENV, str(tmp_path))
    build_dir = cpu_library.extension_dir("avx2") / "build"
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()  # what torch's FileBaton leaves behind when its builder is killed

    def fake_load(name: str, build_directory: str, **kwargs: Any) -> str:
        assert not (Path(build_directory) / "lock").exists()  # torch would wait for it forever
        (Path(build_directory) / f"{name}.so").write_bytes(b"built")
        return "module"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    library, module = cpu_library._build("avx2")
    assert module == "module" and library.read_bytes() == b"built"
    assert cpu_library._build("avx2") == (library, None)  # built once: later starts only load it
