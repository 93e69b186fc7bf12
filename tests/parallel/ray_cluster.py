"""A two-node Ray cluster on 127.0.0.1 for the Ray executor's tests: a head and a second node joined with
``ray start --address``, one CPU each, in a temp dir of their own; stopped by killing exactly the processes whose
command lines name that dir (and their children), never ``ray stop`` (which stops every Ray process on the machine).

Ray rewrites 127.0.0.1 to the machine's routable IP wherever it finds a route (its node-IP detection asks which
address reaches 8.8.8.8), so the tests run in a network namespace whose only interface is loopback: there Ray
reports 127.0.0.1 for every node and no other address exists (``loopback_only``; test_ray_executor.py re-runs itself
under ``unshare -n``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from folio.bench.server_proc import free_port

_START_TIMEOUT_S = 120.0  # hang guard only
# the subprocesses' own environment only (the engine reads none): no usage report attempts from the head, and the
# workers at normal priority (Ray starts them at nice 15, where beside CI's other pytest workers they starved: the
# module's run took 400-480 s in the suite, 77-94 s at nice 0)
_RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0"}


def loopback_only() -> bool:
    """Whether this process's network namespace has no interface but lo (so that Ray can only use 127.0.0.1)."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


@dataclass
class LocalRayCluster:
    temp_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="folio-ray-", dir="/tmp")))
    port: int = field(default_factory=free_port)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """The head, then the second node; raises (with ray's output) if either does not start."""
        common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--object-store-memory=100000000"]
        self._ray(
            "start",
            "--head",
            f"--port={self.port}",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={self.temp_dir}",  # short: Ray's socket paths must fit in 107 bytes
            *common,
        )
        # one log monitor for the machine: both nodes write to the head's session dir (two would print each line twice)
        self._ray("start", f"--address={self.address}", "--include-log-monitor=false", *common)

    def stop(self) -> None:
        """Kills the cluster's processes (the head's and the node's daemons, their actors and workers)."""
        procs: set[psutil.Process] = set()
        for proc in psutil.process_iter(["cmdline"]):
            if any(str(self.temp_dir) in arg for arg in proc.info["cmdline"] or []):
                procs.add(proc)
                with contextlib.suppress(psutil.NoSuchProcess):
                    procs.update(proc.children(recursive=True))
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        _, alive = psutil.wait_procs(list(procs), timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        assert not alive, f"Ray processes outlived the kill: {alive}"

    def _ray(self, *args: str) -> None:
        cli = Path(sys.executable).with_name("ray")
        result = subprocess.run(
            [str(cli), *args],
            env={**os.environ, **_RAY_ENV},
            capture_output=True,
            text=True,
            timeout=_START_TIMEOUT_S,
        )
        assert result.returncode == 0, f"ray {' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
