"""Start `pagedserve serve` as a real child process for tests, and make sure nothing outlives it.

The server runs in its own session (process group); the engine process it starts inherits that
group, so `stop()` can always SIGKILL the whole group as a last resort, even when a test failed
half-way. Output goes to a log file that is printed when startup fails.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc; Linux)."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(entry))
    return children


def pid_exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class ServerProcess:
    def __init__(self, model: str, extra_args: list[str], api_key: str | None = None,
                 startup_timeout: float = 180.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile(prefix="pagedserve-server-", suffix=".log", delete=False)
        command = [sys.executable, "-m", "pagedserve.cli", "serve", "--model", model, "--port", str(self.port),
                   *extra_args]
        if api_key is not None:
            command += ["--api-key", api_key]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env.pop("PAGEDSERVE_API_KEY", None)
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        self.engine_pid: int | None = None
        try:
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def read_log(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode} while starting:\n{self.read_log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    children = child_pids(self.process.pid)
                    self.engine_pid = children[0] if children else None
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy within {timeout} s:\n{self.read_log()}")

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL the whole process group; returns the server's exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # Anything left in the group (nothing, normally).
        except ProcessLookupError:
            pass
        if self.process.poll() is None:
            self.process.wait(timeout=10)
        self.log.close()
        return self.process.returncode
