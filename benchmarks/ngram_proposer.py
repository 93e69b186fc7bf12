"""Cost of one n-gram proposal (prompt lookup) against the history length, with the search it replaced.

    .venv/bin/python benchmarks/ngram_proposer.py
    .venv/bin/python benchmarks/ngram_proposer.py --lengths 500 4000 --max-n 5 --min-n 2

The worker proposes for every request of every step, so at a batch of 64 long requests the proposals are a
share of the step. Folio's proposer (folio/spec_decode/ngram_proposer.py) compares the history with its last
token once and grows the few candidates' matches backwards; the peer, measured in the same run, is the search
it replaced: one sliding-window comparison of the whole history per n (the same choice: longest n, earliest
position). Each is given what the worker gives it: Folio the request's int64 token array (kept by the worker,
appended to each step), the peer the history as the worker used to build it (prompt + output lists). Random
tokens (few matches: the search is all the cost). Prints microseconds per proposal; nothing is asserted.
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from collections.abc import Callable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from folio.spec_decode.ngram_proposer import NgramProposer


def sliding_window_search(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The previous implementation: for each n, longest first, every window of the history against the suffix."""
    tokens = np.asarray(token_ids)
    num_tokens = len(tokens)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[: num_tokens - 1], n)
        hits = np.flatnonzero((windows == tokens[num_tokens - n :]).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return [int(t) for t in tokens[start : start + k]]
    return []


def best_microseconds(fn: Callable[[], object], calls: int, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[200, 2000, 8000], help="history lengths")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--min-n", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--max-n", type=int, default=5, help="prompt_lookup_max")
    parser.add_argument("--vocab", type=int, default=49152)
    ns = parser.parse_args()
    proposer = NgramProposer(ns.k, ns.min_n, ns.max_n)
    rng = random.Random(0)
    print(f"n-gram proposal, k={ns.k}, n {ns.max_n}..{ns.min_n}, random tokens of {ns.vocab}; microseconds per call")
    print(f"| {'history':>8} | {'folio':>8} | {'sliding-window search':>22} | {'ratio':>6} |")
    print(f"|{'-' * 10}|{'-' * 10}|{'-' * 24}|{'-' * 8}|")
    for length in ns.lengths:
        prompt = [rng.randrange(ns.vocab) for _ in range(length - 64)]
        output = [rng.randrange(ns.vocab) for _ in range(64)]
        array = np.asarray(prompt + output, dtype=np.int64)
        expected = sliding_window_search(prompt + output, ns.k, ns.min_n, ns.max_n)
        if proposer.propose(array) != expected:
            raise SystemExit(f"the proposals differ at length {length}")
        calls = max(20, 200_000 // length)
        ours = best_microseconds(functools.partial(proposer.propose, array), calls)
        history = functools.partial(lambda p, o: sliding_window_search(p + o, ns.k, ns.min_n, ns.max_n), prompt, output)
        peer = best_microseconds(history, calls)
        print(f"| {length:>8} | {ours:>8.1f} | {peer:>22.1f} | {peer / ours:>5.1f}x |")


if __name__ == "__main__":
    main()
