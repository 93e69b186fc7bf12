"""CPU tensors backed by transparent huge pages (2 MiB) where the kernel offers them.

Why: the weights of a decode step stream from memory once per step, and each 4 KiB page boundary costs a TLB
miss and stops the hardware prefetcher. Linux's default THP mode on many servers is "madvise": a region gets
huge pages only when asked, before its first touch. Elsewhere (other OSes, THP off) this is a plain tensor.
The engine argument cpu_huge_pages turns the advice off: on VMs whose host takes freed memory back (page
reporting), a huge page's first touch cost 2-16x a small page's, seconds per GiB at start (docs/performance.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE, _MADV_NOHUGEPAGE = 14, 15  # linux/mman.h


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


# A first touch slower than this, for long enough to notice at start, gets a hint in the log (4 KiB pages fault in
# at 2-4 GB/s on the slow VMs seen, huge pages at 0.2-1.8).
_SLOW_TOUCH_SECONDS, _SLOW_TOUCH_GIB_PER_S = 2.0, 1.0


def slow_first_touch_hint(what: str, nbytes: int, seconds: float) -> str | None:
    """A start-up line for memory on huge pages that took long to fault in, naming the flag that avoids it; None
    where it was quick enough."""
    gib = nbytes / 2**30
    if seconds < _SLOW_TOUCH_SECONDS or gib / seconds >= _SLOW_TOUCH_GIB_PER_S:
        return None
    return (
        f"{what}: {gib:.2f} GiB faulted in on 2 MiB pages in {seconds:.1f} s ({gib / seconds:.2f} GiB/s); where huge "
        "pages are this slow to touch first (VMs whose host takes freed memory back), --no-cpu-huge-pages "
        "(cpu_huge_pages=False) starts faster"
    )


def empty_hugepage_backed(numel: int, dtype: torch.dtype, huge_pages: bool = True) -> torch.Tensor:
    """An uninitialized 1-D CPU tensor of numel elements, starting on a 2 MiB boundary and advised to use huge
    pages, or with ``huge_pages`` False advised not to (memory the heap hands back out keeps an earlier advice
    unless told; THP "always" would give it huge pages too). A no-op where madvise is not available: the tensor
    is the same either way."""
    nbytes = numel * dtype.itemsize
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE_PAGE
    aligned = raw[start : start + nbytes]
    madvise = _madvise()
    huge_bytes = nbytes - nbytes % _HUGE_PAGE
    if madvise is not None and huge_bytes:  # advice only: a failure changes nothing
        madvise(aligned.data_ptr(), huge_bytes, _MADV_HUGEPAGE if huge_pages else _MADV_NOHUGEPAGE)
    return aligned.view(dtype)
