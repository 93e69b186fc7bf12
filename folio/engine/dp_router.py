"""Data parallelism's router: which engine core each request goes to (docs/scale_out.md, "Data parallelism").

Two facts per engine decide: how many of the prompt's leading KV blocks the engine's prefix cache probably holds,
and its load (requests the API process has in flight there). The API process cannot see the engines' caches, so it
keeps its own record of the block hashes it sent each engine: an LRU-bounded set per engine, an approximation of
the cache (which also evicts), as SGLang's router keeps an approximate radix tree. The hashes are the KV cache
manager's own (``folio/core/block_hash.py``, sha256 chains over full blocks), so a leading match of k hashes means
the first k blocks of the prompt were sent to that engine before. Pure Python, no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from folio.core.block_hash import extend_block_hashes


@dataclass(frozen=True)
class RoutingPolicy:
    """The two thresholds of ``choose_engine``; see there for why each exists."""

    # A prefix must cover this many blocks more than the least-loaded engine holds before it outweighs load: one
    # block (16 tokens) is a chat template's preamble that every engine soon holds, not a reason to queue.
    min_prefix_blocks: int = 2
    # A prefix-holding engine may carry this many requests more than the least-loaded one (or this share of the
    # least load, whichever is larger) before a hot prefix spills to the least-loaded engine (which then holds it
    # too: the prefix is computed once more, not once per request). 16, measured against 4 and 32 on a prefix-heavy
    # load (docs/scale_out.md): 4 spilled prefixes to both engines under queueing (hit rate 50-63% against 80%),
    # 32 held one hot prefix's requests on one engine longer (more TTFT) for no more hits. SGLang's router allows 32.
    max_load_gap: int = 16
    max_load_ratio: float = 0.25

    def __post_init__(self) -> None:
        if self.min_prefix_blocks < 1 or self.max_load_gap < 0 or self.max_load_ratio < 0:
            raise ValueError(f"routing policy thresholds must be >= 0 (min_prefix_blocks >= 1), got {self}")


def choose_engine(matched_blocks: Sequence[int], loads: Sequence[int], policy: RoutingPolicy | None = None) -> int:
    """The engine for one request, from each engine's matched prefix (in blocks) and load (requests in flight).

    1. The least-loaded engine is the default (ties: the one with the longer match, then the lowest index), as
       vLLM's data-parallel load balancer picks the engine with the fewest waiting + running requests.
    2. Among the engines whose load is within the allowed gap of that least load, the one with the longest match
       (ties: lower load, then lower index) wins instead when its match is at least ``min_prefix_blocks`` longer
       than the default's: its cache saves that prefill. Past the gap the load wins, so one hot prefix cannot pile
       every request onto one engine (SGLang's router switches to the shortest queue when load is imbalanced).
    Example: matched [6, 0], loads [3, 1] -> 0 (6 blocks cached there, 2 more requests is within the gap);
    matched [6, 0], loads [18, 1] -> 1 (gap 17 > 16); matched [1, 0], loads [1, 0] -> 1 (a 1-block match is short).
    """
    policy = policy or RoutingPolicy()
    engines = range(len(loads))
    default = min(engines, key=lambda i: (loads[i], -matched_blocks[i], i))
    least = loads[default]
    allowed = least + max(policy.max_load_gap, int(least * policy.max_load_ratio))
    best = min((i for i in engines if loads[i] <= allowed), key=lambda i: (-matched_blocks[i], loads[i], i))
    if matched_blocks[best] - matched_blocks[default] >= policy.min_prefix_blocks:
        return best
    return default


class PrefixRecord:
    """The block hashes the router sent one engine, least recently sent first, at most ``capacity`` of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def matched_blocks(self, block_hashes: Sequence[int]) -> int:
        """How many leading hashes of the prompt are recorded: the length of its probably cached prefix."""
        num_matched = 0
        for block_hash in block_hashes:
            if block_hash not in self._hashes:
                break
            num_matched += 1
        return num_matched

    def record(self, block_hashes: Sequence[int]) -> None:
        """Marks the prompt's blocks as just sent. The last block is touched first and the first block last, so the
        eviction (oldest first) drops a prefix's tail before its head, as the KV cache frees a request's blocks
        tail first: a leading match never loses its first blocks while later ones stay."""
        for block_hash in reversed(block_hashes):
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)


# "prefix": choose_engine's rule (the default); "load": the least-loaded engine only; "round_robin": in turn, blind
# to both (SGLang's round_robin; for comparisons, benchmarks/data_parallel.py).
DATA_PARALLEL_ROUTINGS = ("prefix", "load", "round_robin")


class DPRouter:
    """Routes requests to engines and counts each engine's requests in flight (its load).

    ``num_blocks``: each engine's KV blocks (the bound of its record). Without prefix caching only load counts.
    A request is in flight from ``route`` until ``release`` (its engine finished or aborted it).
    """

    def __init__(
        self,
        num_blocks: Sequence[int],
        block_size: int,
        prefix_caching: bool = True,
        policy: RoutingPolicy | None = None,
        routing: str = "prefix",
    ) -> None:
        if routing not in DATA_PARALLEL_ROUTINGS:
            raise ValueError(f"data_parallel_routing must be one of {DATA_PARALLEL_ROUTINGS}, got {routing!r}")
        self.block_size = block_size
        self.prefix_caching = prefix_caching and routing == "prefix"
        self.round_robin = routing == "round_robin"
        self.policy = policy or RoutingPolicy()
        self.records = [PrefixRecord(n) for n in num_blocks]
        self.loads = [0] * len(num_blocks)
        self._engine_of: dict[str, int] = {}
        self._num_routed = 0

    @property
    def num_engines(self) -> int:
        return len(self.loads)

    def route(self, request_ids: Sequence[str], prompt_token_ids: Sequence[int]) -> int:
        """The engine for the requests of one prompt (n > 1 siblings stay together: they share its blocks)."""
        engine = 0
        if self.num_engines > 1:
            block_hashes: list[int] = []
            if self.prefix_caching:
                extend_block_hashes(block_hashes, prompt_token_ids, self.block_size)
            matched = [record.matched_blocks(block_hashes) for record in self.records]
            engine = choose_engine(matched, self.loads, self.policy)
            if self.round_robin:
                engine = self._num_routed % self.num_engines
            self._num_routed += 1
            self.records[engine].record(block_hashes)
        for request_id in request_ids:
            self._engine_of[request_id] = engine
        self.loads[engine] += len(request_ids)
        return engine

    def engine_of(self, request_id: str) -> int | None:
        """The engine of a request in flight; None once released (or never routed)."""
        return self._engine_of.get(request_id)

    def release(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """Ends the requests that are in flight; returns them by engine (those to tell about an abort)."""
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            engine = self._engine_of.pop(request_id, None)
            if engine is not None:
                self.loads[engine] -= 1
                by_engine.setdefault(engine, []).append(request_id)
        return by_engine
