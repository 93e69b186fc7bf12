"""All-reduce and all-gather through one shared-memory segment, for the tensor-parallel ranks of one machine on
the CPU (what vLLM's CPU backend and SGLang do). A gloo all-reduce of a decode row goes through TCP and costs
milliseconds on a loaded machine; here a rank copies its tensor into its slot, raises its counter and reads its
peers' slots (docs/scale_out.md has the figures).

Segment (created by rank 0, its name sent over the group's gloo broadcast, unlinked as soon as every rank has
mapped it, so that nothing is left in /dev/shm whichever process dies, SIGKILL included):
    header  one cache line per rank: its step counter (int64); then one per rank: its pid
    data    2 parities x world_size slots of slot_bytes
Round s (1, 2, ...) of every collective: each rank copies its chunk into slot [s % 2][rank], sets its counter to
s, waits until every counter is >= s, then reads the slots of parity s % 2. A rank writes that parity again only
in round s + 2, after every rank has arrived at round s + 1, that is after every rank has finished reading round
s: one barrier per round. The sum is taken in rank order 0, 1, ..., N-1 on every rank, so every rank holds the
same bits. Tensors larger than a slot go in chunks of slot_bytes (elementwise sums do not care).

Ordering: the counter is written after the data and read before it; x86's total store order keeps those in
order without fences, so the shared-memory path is used on x86-64 only (gloo elsewhere: ``shm_supported``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import secrets
import tempfile
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

_LINE = 64  # bytes per counter: one cache line each, so that a rank's writes do not invalidate its peers' lines
DEFAULT_SLOT_BYTES = 1 << 20  # a [64, 576] float32 decode batch is 144 KiB; a 2048-token prefill row block 4.5 MiB
# Waiting (measured on 2 cores shared with other jobs, docs/scale_out.md): spinning before yielding did not lower
# the median of a 2-rank decode-row all-reduce (11.5 us) and raised its p90 (yield at once 34 us, after 10 / 50 /
# 200 us of spinning 55 / 135 / 444 us, a pure spin 16 ms: it starves a peer that shares the core), so the waiter
# yields the core at every check (sched_yield returns at once when nothing else wants the core); once the wait is
# long (the peer computes a prefill, or is descheduled) it sleeps between checks instead of burning a core that
# other processes could use.
SPIN_S = 0.0
YIELD_S = 0.002
SLEEP_S = 5e-5
LIVENESS_EVERY_S = 0.01  # how often a long wait checks that the ranks it waits for are alive


class PeerDiedError(RuntimeError):
    """A rank this one waits for is gone (or a zombie). Seen before the engine core can reap that rank (a killed
    process's threads are still exiting), so the executor gives the peers' sentinels a moment before it names
    the rank that died (folio/executor/multiproc.py)."""


def shm_supported() -> bool:
    """The shared-memory path relies on x86's store order (see the module docstring)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class ShmCommunicator:
    """One rank's view of the group's segment: ``all_reduce`` (sum, in place) and ``all_gather`` of CPU tensors."""

    def __init__(self, rank: int, world_size: int, buffer: mmap.mmap, slot_bytes: int, timeout_s: float) -> None:
        self.rank, self.world_size, self.slot_bytes, self.timeout_s = rank, world_size, slot_bytes, timeout_s
        self._mm = buffer
        header = np.frombuffer(buffer, dtype=np.int64, count=2 * world_size * _LINE // 8)
        self._counters = header[: world_size * _LINE // 8 : _LINE // 8]  # [world_size], strided by a cache line
        self._pids = header[world_size * _LINE // 8 :: _LINE // 8]
        self._pids[rank] = os.getpid()
        data_offset = _header_bytes(world_size)
        # slots[parity][rank]: slot_bytes of raw bytes; typed views per dtype are cut from them on first use
        self._slots = [
            [
                torch.frombuffer(
                    buffer, dtype=torch.uint8, count=slot_bytes, offset=data_offset + (p * world_size + r) * slot_bytes
                )
                for r in range(world_size)
            ]
            for p in range(2)
        ]
        self._typed: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._round = int(self._counters[rank])  # 0 for a fresh segment
        self.spin_s, self.yield_s = SPIN_S, YIELD_S  # the waiting policy (benchmarks/scale_out.py varies it)

    @staticmethod
    def create(
        group: Any, rank: int, world_size: int, slot_bytes: int = DEFAULT_SLOT_BYTES, timeout_s: float = 300.0
    ) -> ShmCommunicator:
        """Collective over the torch.distributed ``group`` (every member calls it): rank 0 creates the segment and
        broadcasts its name, the others map it, and rank 0 unlinks the name once every rank holds the mapping."""
        size = _header_bytes(world_size) + 2 * world_size * slot_bytes
        path = None
        try:
            if rank == 0:
                directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
                path = os.path.join(directory, f"folio_tp_{os.getpid()}_{secrets.token_hex(6)}")
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, size)  # zero-filled: every counter starts at 0
                finally:
                    os.close(fd)
            names = [path]
            dist.broadcast_object_list(names, group=group, group_src=0)
            assert names[0] is not None
            fd = os.open(names[0], os.O_RDWR)
            try:
                buffer = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            dist.barrier(group=group)  # every rank has mapped it: the name can go
        finally:
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        return ShmCommunicator(rank, world_size, buffer, slot_bytes, timeout_s)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks in place (rank order 0..N-1, the same bits on every rank); returns it."""
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        chunk = self.slot_bytes // x.element_size()
        for start in range(0, flat.numel(), chunk):
            part = flat[start : start + chunk]
            slots = self._exchange(part)
            n = part.numel()
            torch.add(slots[0][:n], slots[1][:n], out=part)
            for slot in slots[2:]:
                part.add_(slot[:n])
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view(x.shape))
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[...] on every rank -> [world_size, ...]: every rank's x, in rank order."""
        flat = x.contiguous().view(-1)
        out = torch.empty((self.world_size, flat.numel()), dtype=x.dtype)
        chunk = self.slot_bytes // x.element_size()
        for start in range(0, flat.numel(), chunk):
            part = flat[start : start + chunk]
            slots = self._exchange(part)
            n = part.numel()
            for r, slot in enumerate(slots):
                out[r, start : start + n].copy_(slot[:n])
        return out.view(self.world_size, *x.shape)

    def close(self) -> None:
        """Drops this rank's mapping (the name is gone since start-up; the memory goes with the last mapping)."""
        self._slots, self._typed = [], {}
        self._counters = self._pids = np.empty(0, dtype=np.int64)
        with contextlib.suppress(BufferError):  # a caller still holds a view: the mapping goes with the process
            self._mm.close()

    def _exchange(self, part: torch.Tensor) -> list[torch.Tensor]:
        """One round: part (at most a slot) into this rank's slot, then every rank's slot of this round's parity
        (typed views of the slot's full length) once all have arrived."""
        self._round += 1
        slots = self._typed_slots(self._round % 2, part.dtype)
        slots[self.rank][: part.numel()].copy_(part)
        self._counters[self.rank] = self._round  # after the data (x86 store order: seen after it)
        self._wait_all(self._round)
        return slots

    def _typed_slots(self, parity: int, dtype: torch.dtype) -> list[torch.Tensor]:
        slots = self._typed.get((parity, dtype))
        if slots is None:
            slots = [raw.view(dtype) for raw in self._slots[parity]]
            self._typed[(parity, dtype)] = slots
        return slots

    def _wait_all(self, target: int) -> None:
        """Returns once every rank's counter is >= target; raises RuntimeError naming the rank when one died or
        did not arrive within timeout_s. Spins for spin_s, then yields the core at each check until yield_s, then
        sleeps SLEEP_S between checks."""
        counters = self._counters
        started = next_liveness = 0.0
        for r in range(self.world_size):
            while counters[r] < target:
                now = time.perf_counter()
                if not started:
                    started, next_liveness = now, now + LIVENESS_EVERY_S
                    continue
                waited = now - started
                if waited < self.spin_s:
                    continue
                if waited < self.yield_s:
                    os.sched_yield()
                    continue
                time.sleep(SLEEP_S)
                if now >= next_liveness:
                    next_liveness = now + LIVENESS_EVERY_S
                    self._check_peers(target, waited)

    def _check_peers(self, target: int, waited: float) -> None:
        missing = [r for r in range(self.world_size) if self._counters[r] < target]
        for r in missing:
            pid = int(self._pids[r])
            if not _pid_alive(pid):
                raise PeerDiedError(
                    f"shared-memory all-reduce on rank {self.rank}: rank {r} (pid {pid}) died (round {target})"
                )
        if waited > self.timeout_s:
            raise RuntimeError(
                f"shared-memory all-reduce on rank {self.rank}: rank {missing[0]} did not arrive within "
                f"{self.timeout_s:g} s (round {target})"
            )


def _header_bytes(world_size: int) -> int:
    return -(-2 * world_size * _LINE // 4096) * 4096  # the slots start page-aligned


def _pid_alive(pid: int) -> bool:
    """False when the process is gone or a zombie (killed, not yet reaped by the engine core)."""
    if pid <= 0:
        return True  # not written yet: its rank has not reached this segment, the timeout covers it
    if not os.path.isdir("/proc"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    state = stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3]  # "pid (comm) S ...": comm may hold spaces
    return state not in (b"Z", b"X")
