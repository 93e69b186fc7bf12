"""A `folio serve` subprocess on 127.0.0.1 and a free port, for benchmarks that need a fresh server per setting.

Started the way tests/server/conftest.py starts its servers: the same interpreter (``python -m folio.cli serve``),
output to a log file (a pipe could fill up and block the server), ready once ``GET /health`` answers 200, stopped
with SIGTERM (the server drains, then exits 0).
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 40.0
# Free ports are drawn from here up: clear of fixed service ports and of Ray's default worker ports (10002-19999),
# where a Ray node started beside our servers binds its workers (and which it refuses as its head's port).
_FIRST_FREE_PORT = 20000


def free_port() -> int:
    """A port that was free a moment ago, for a server that binds it right after: drawn below the kernel's
    ephemeral range, which outgoing connections and other bind-to-0 callers draw from, so that no client of a busy
    machine takes it in between (seen as a rare EADDRINUSE with two test workers starting servers); any free port
    where nothing lies below that range."""
    low = _ephemeral_range_start()
    for port in random.sample(range(_FIRST_FREE_PORT, low), min(64, max(0, low - _FIRST_FREE_PORT))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ephemeral_range_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def wait_healthy(url: str, process: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> None:
    """Until ``GET url/health`` answers 200. RuntimeError with the log's tail if the process exits first,
    TimeoutError (also with the tail) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args} exited with {process.returncode}:\n{_tail(log_path)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} was not healthy after {timeout_s:.0f} s:\n{_tail(log_path)}")


def _tail(log_path: Path, num_chars: int = 3000) -> str:
    return log_path.read_text(errors="replace")[-num_chars:] if log_path.exists() else ""


class ServeProcess:
    """One `folio serve` with ``serve_args`` (engine and server flags); ``start`` waits until it is healthy."""

    def __init__(self, serve_args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.args = [sys.executable, "-m", "folio.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        self.args += ["--uvicorn-log-level", "warning", *serve_args]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Starts the server and waits for /health; RuntimeError with the log's tail if it exits or times out."""
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.base_url, self.process, self.log_path, timeout_s)
        except TimeoutError:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within STOP_TIMEOUT_S."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""
