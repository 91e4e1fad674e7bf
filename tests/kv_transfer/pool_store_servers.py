"""KV pool store servers for tests: redis-server or mooncake_master on a free port of 127.0.0.1, started and
stopped by the test (a missing binary or library skips the test, naming why)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_for_port(process: subprocess.Popen, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{process.args[0]} did not listen on 127.0.0.1:{port} within {timeout_s} s")


class StoreServer:
    """One store server process; `url` is what PoolConnector's kv_connector_extra_config.url takes."""

    def __init__(self, backend: str, port: int | None = None) -> None:
        """Skips the test at once when the backend's server or client is missing."""
        self.backend = backend
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None
        self.url = f"{backend}://127.0.0.1:{self.port}" + ("/0" if backend == "redis" else "")
        if backend == "redis":
            binary = shutil.which("redis-server")
            if binary is None:
                pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
            pytest.importorskip("redis", reason="the redis client is not installed (pip install 'pagedserve[pool]')")
            self.command = [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly",
                            "no", "--protected-mode", "yes"]
        else:
            binary = shutil.which("mooncake_master")
            if binary is None:
                pytest.skip("mooncake_master is not installed (pip install mooncake-transfer-engine-non-cuda)")
            try:
                import mooncake.store  # noqa: F401  (needs Debian's libibverbs1)
            except (ImportError, OSError) as error:
                pytest.skip(f"the mooncake store client does not import: {error} (Debian: apt-get install "
                            f"libibverbs1)")
            self.command = [binary, "--rpc_address=127.0.0.1", f"--rpc_port={self.port}",
                            "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}"]

    def start(self) -> "StoreServer":
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        env=os.environ)
        _wait_for_port(self.process, self.port, 20.0)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
