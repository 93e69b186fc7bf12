"""The comparison rounds' count and the median run a side is reported by (folio/bench/rounds.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from folio.bench.rounds import median_run, num_rounds


@dataclass
class _Run:
    elapsed_s: float


def test_num_rounds_takes_the_flag_else_the_default_and_refuses_below_one() -> None:
    assert num_rounds(None, default=3) == 3 and num_rounds(5, default=1) == 5
    with pytest.raises(ValueError, match=r"compare_rounds must be >= 1, got 0"):
        num_rounds(0, default=3)


def test_median_run_of_odd_and_even_counts() -> None:
    runs = [_Run(3.0), _Run(1.0), _Run(2.0)]
    assert median_run(runs) is runs[2]
    even = [_Run(4.0), _Run(1.0)]
    assert median_run(even) is even[0]  # the slower of the middle two
