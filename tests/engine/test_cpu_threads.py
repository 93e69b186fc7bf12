"""CpuThreadGovernor (folio/worker/cpu_threads.py): fewer kernel threads while others take cores, back when not."""

from __future__ import annotations

from folio.worker.cpu_threads import CpuThreadGovernor, run_queue_wait_seconds


class FakeClocks:
    """Wall time and run-queue wait that the test advances (the real ones are the kernel's)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.wait = 0.0

    def advance(self, seconds: float, lost_cores: float) -> None:
        self.now += seconds
        self.wait += seconds * lost_cores


def make(max_threads: int) -> tuple[CpuThreadGovernor, FakeClocks]:
    clocks = FakeClocks()
    governor = CpuThreadGovernor(max_threads, 0.5, 5.0, 0.25, lambda: clocks.now, lambda: clocks.wait)
    return governor, clocks


def test_quiet_machine_keeps_every_thread() -> None:
    governor, clocks = make(2)
    for _ in range(40):
        clocks.advance(0.1, 0.05)
        assert governor.threads_for_step() == 2


def test_a_busy_neighbour_takes_a_thread_and_a_probe_gives_it_back_once_it_left() -> None:
    governor, clocks = make(2)
    clocks.advance(0.3, 0.7)
    assert governor.threads_for_step() == 2  # within the first window: no decision yet
    clocks.advance(0.3, 0.7)
    assert governor.threads_for_step() == 2  # 0.7 cores lost over one window: maybe a blip
    clocks.advance(0.5, 0.7)
    assert governor.threads_for_step() == 1  # and over the next: a neighbour that lasts
    for _ in range(9):  # 4.5 s on one thread: no wait, but no probe before 5 s
        clocks.advance(0.5, 0.0)
        assert governor.threads_for_step() == 1
    clocks.advance(0.5, 0.0)
    assert governor.threads_for_step() == 2  # probe
    clocks.advance(0.5, 0.7)
    assert governor.threads_for_step() == 1  # the neighbour is still there
    for _ in range(10):
        clocks.advance(0.5, 0.0)
        governor.threads_for_step()
    clocks.advance(0.5, 0.02)  # probing again: quiet now
    assert governor.threads_for_step() == 2
    for _ in range(20):
        clocks.advance(0.5, 0.02)
        assert governor.threads_for_step() == 2


def test_a_blip_of_another_process_takes_no_thread() -> None:
    """One window of wait (a shell command beside the engine) must not cost the engine a core for 5 s."""
    governor, clocks = make(2)
    for _ in range(5):
        clocks.advance(0.5, 0.02)
        assert governor.threads_for_step() == 2
        clocks.advance(0.5, 0.9)  # a blip, every other window
        assert governor.threads_for_step() == 2


def test_a_large_machine_loses_only_the_cores_taken() -> None:
    governor, clocks = make(32)
    clocks.advance(1.0, 2.5)
    assert governor.threads_for_step() == 32  # the first window of it
    clocks.advance(1.0, 2.5)
    assert governor.threads_for_step() == 29
    clocks.advance(1.0, 1.2)  # one more core taken: no second confirmation needed
    assert governor.threads_for_step() == 27


def test_run_queue_wait_is_read_from_this_process() -> None:
    first = run_queue_wait_seconds()
    assert first >= 0.0 and run_queue_wait_seconds() >= first
