"""How many threads the CPU kernels use while other processes share the cores.

Every kernel is an OpenMP region whose barriers wait for the slowest thread. When another process takes a core,
one of our threads sits descheduled for a whole time slice and every barrier of the step waits for it: W1 fell
about 10x (170+ to 17-22 tok/s) with one busy process beside it on two cores (docs/performance.md). With one
thread fewer than the cores the competitor leaves free, no barrier waits for a descheduled thread.

The signal is the kernel's own: the time our threads spent runnable but waiting for a CPU (``schedstat``'s run
queue wait). Over a window of steps, that wait in cores (wait / wall) is how much of the machine others took;
the governor runs that many threads fewer, and every ``probe_after_s`` tries the full count again in case the
competitor has left. A first sighting must last ``confirm_windows`` windows: a blip (a shell command, a burst of
another process) would otherwise halve two cores for a whole probe period, 5 s, for a wait of a tenth of a second
(on a Zen 3 VM a W1 run beside a script that started a `python3` every 5 s ran at 206 tok/s, about 250 without it;
docs/performance.md, session 42). A probe that finds the competitor still there takes the threads back at once.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path


def run_queue_wait_seconds() -> float:
    """Seconds this process's threads have spent runnable but waiting for a CPU (/proc/self/task/*/schedstat:
    on-CPU ns, run-queue wait ns, time slices), or 0.0 where the kernel does not report it."""
    total_ns = 0
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return 0.0
    for task in tasks:
        try:
            total_ns += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the thread exited, or no schedstat
    return total_ns / 1e9


class CpuThreadGovernor:
    """Before each step, the thread count for the CPU kernels (``threads_for_step``)."""

    def __init__(
        self,
        max_threads: int,
        window_s: float = 0.5,
        probe_after_s: float = 5.0,
        lost_cores_threshold: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        wait_clock: Callable[[], float] = run_queue_wait_seconds,
        confirm_windows: int = 2,
    ) -> None:
        """max_threads: the quiet machine's count; window_s: how much wall time one decision sees;
        lost_cores_threshold: the run-queue wait, in cores, above which threads are taken away; confirm_windows:
        consecutive windows above it before a competitor not seen at the last probe counts."""
        self.max_threads = max_threads
        self.threads = max_threads
        self._window_s, self._probe_after_s, self._threshold = window_s, probe_after_s, lost_cores_threshold
        self._clock, self._wait_clock = clock, wait_clock
        self._window_start, self._wait_start = clock(), wait_clock()
        self._reduced_at: float | None = None
        self._confirm_windows = confirm_windows
        self._windows_over = 0  # consecutive windows above the threshold at the full count
        self._probing = False  # the full count is back for a probe: a competitor was there probe_after_s ago

    def threads_for_step(self) -> int:
        """The count to use for the next step; decides at most once per window, so a step costs a clock read."""
        now = self._clock()
        elapsed = now - self._window_start
        if elapsed < self._window_s:
            return self.threads
        lost_cores = (self._wait_clock() - self._wait_start) / elapsed
        over = lost_cores > self._threshold and self.threads > 1
        self._windows_over = self._windows_over + 1 if over else 0
        probing, self._probing = self._probing, False
        if over and (probing or self.threads < self.max_threads or self._windows_over >= self._confirm_windows):
            self.threads = max(1, self.threads - math.ceil(lost_cores))
            self._reduced_at, self._windows_over = now, 0
        elif self._reduced_at is not None and now - self._reduced_at >= self._probe_after_s:
            self.threads = self.max_threads  # the next window says whether the competitor is still there
            self._reduced_at, self._probing = None, True
        self._window_start, self._wait_start = now, self._wait_clock()
        return self.threads


def default_cpu_threads() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
