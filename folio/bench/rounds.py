"""The rounds of a benchmark's A/B comparison (``--compare-rounds``): how many, and which run of a side to report.

Both sides run the same number of rounds, interleaved, so that a slow spell of a shared machine falls on both; each
side is reported by its median run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


class _Timed(Protocol):
    @property
    def elapsed_s(self) -> float: ...


TimedRun = TypeVar("TimedRun", bound=_Timed)


def num_rounds(requested: int | None, default: int) -> int:
    """``--compare-rounds`` as given, else the comparison's default; fewer than 1 is an error naming the flag."""
    rounds = default if requested is None else requested
    if rounds < 1:
        raise ValueError(f"compare_rounds must be >= 1, got {rounds}")
    return rounds


def median_run(runs: Sequence[TimedRun]) -> TimedRun:
    """The run of median elapsed time (of an even count, the slower of the middle two)."""
    return sorted(runs, key=lambda run: run.elapsed_s)[len(runs) // 2]
