"""How the multiprocess executor starts its CPU ranks: forked from a fork server that has imported torch and the
worker's modules, so that a rank costs a fork instead of a fresh interpreter importing torch (about 2 CPU-s and
most of a rank's start; a tp=2 start imports once instead of twice, later executors in the same process not at
all). Unlike a plain fork of the engine's own process, no thread, lock or CUDA state of the engine comes along.

A forked rank would otherwise see what the fork server had when it started, not what its engine has now: each rank
gets the engine's current environment (read by MKL and oneDNN when they start, after the fork) and its
current stdout and stderr (a log redirected or captured since gets the ranks' lines, as with spawned ranks).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from typing import Any

# Imported once by the fork server, before any rank: none of them starts a thread or touches a device at import.
_PRELOAD = ["torch", "folio.executor.worker_proc", "folio.worker.worker", "folio.parallel.group"]


def rank_process_context(device_type: str) -> Any:
    """The multiprocessing context ranks on ``device_type`` start in. CPU ranks: the fork server's, which starts at
    the first rank and lives as long as this process (it exits when this process does). CUDA ranks are spawned,
    as before: a process forked after anything in its parent initialised the CUDA driver cannot use CUDA, and the
    fork server's imports are not checked for that on a GPU machine."""
    if device_type != "cpu":
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class EngineSurroundings:
    """The engine's environment and stdout/stderr at the rank's start; pickled into the rank's arguments, applied
    by unpickling them there (before the rank's entry function runs)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing.reduction import DupFd

        descriptors = []
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            with contextlib.suppress(Exception):
                stream.flush()
            descriptors.append(DupFd(fd) if _is_open(fd) else None)
        return _apply_surroundings, (dict(os.environ), *descriptors)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _apply_surroundings(environ: dict[str, str], stdout: Any, stderr: Any) -> None:
    os.environ.clear()
    os.environ.update(environ)
    for target, inherited in ((1, stdout), (2, stderr)):
        if inherited is None:
            continue
        fd = inherited.detach()  # spawn passes the descriptor under its own number, the fork server under a new one
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
