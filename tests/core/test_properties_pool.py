"""Property tests (hypothesis, stateful) of BlockPool and the waiting queues against plain reference models.

BlockPool: random get_new_blocks / touch / free_blocks / cache_full_blocks / lookups / reset against a model made
of a ref-count list, an LRU list of free ids and a hash -> id dict. After every rule the pool equals the model
(ref counts, free-queue order = eviction order, cache map) and ``check_block_pool`` holds.
Queues: random add / prepend / pop / remove against a sorted list; order, peek and the preemption victim agree.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from folio.core.block_pool import BlockPool
from folio.core.request_queue import RequestQueue, create_request_queue
from folio.request import Request
from tests.core.kv_invariants import check_block_pool
from tests.helpers import make_request

SETTINGS = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow],
)
HASHES = st.integers(0, 11)  # few hashes, so that collisions with cached ones are common


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(1)
        self.ref_counts: list[int] = [0]
        self.free: list[int] = [0]  # eviction order: head first
        self.hash_of: dict[int, int] = {}  # block id -> hash, for cached blocks
        self.caching = True

    @initialize(num_blocks=st.integers(1, 12), caching=st.booleans())
    def configure(self, num_blocks: int, caching: bool) -> None:
        self.pool = BlockPool(num_blocks, enable_caching=caching)
        self.ref_counts = [0] * num_blocks
        self.free = list(range(num_blocks))
        self.caching = caching

    def _held(self) -> list[int]:
        return [block_id for block_id, count in enumerate(self.ref_counts) if count > 0]

    @rule(num=st.integers(0, 5))
    def get_new_blocks(self, num: int) -> None:
        if num > len(self.free):
            try:
                self.pool.get_new_blocks(num)
            except ValueError:
                return
            raise AssertionError(f"got {num} blocks with only {len(self.free)} free")
        blocks = self.pool.get_new_blocks(num)
        expected, self.free = self.free[:num], self.free[num:]
        assert [block.block_id for block in blocks] == expected, "not handed out in eviction order"
        for block_id in expected:
            self.ref_counts[block_id] = 1
            self.hash_of.pop(block_id, None)  # reused: evicted from the prefix cache

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        """A prefix hit (revives free cached blocks) or a fork (shares held ones)."""
        candidates = self._held() + list(self.hash_of)
        if not candidates:
            return
        chosen = data.draw(st.lists(st.sampled_from(sorted(set(candidates))), max_size=4, unique=True))
        self.pool.touch([self.pool.blocks[block_id] for block_id in chosen])
        for block_id in chosen:
            if self.ref_counts[block_id] == 0:
                self.free.remove(block_id)
            self.ref_counts[block_id] += 1

    @rule(data=st.data())
    def free_blocks(self, data: st.DataObject) -> None:
        held = self._held()
        if not held:
            return
        chosen = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=4, unique=True))
        self.pool.free_blocks([self.pool.blocks[block_id] for block_id in chosen])
        for block_id in chosen:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free.append(block_id)

    @rule(data=st.data())
    def double_free_is_refused(self, data: st.DataObject) -> None:
        free_ids = sorted(self.free)
        if not free_ids:
            return
        block = self.pool.blocks[data.draw(st.sampled_from(free_ids))]
        try:
            self.pool.free_blocks([block])
        except AssertionError:
            return
        raise AssertionError(f"freed free block {block.block_id}")

    @rule(data=st.data())
    def cache_full_blocks(self, data: st.DataObject) -> None:
        """Blocks just computed by a request enter the cache; a hash already cached keeps its first block."""
        held = self._held()
        if not held:
            return
        chosen = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=3, unique=True))
        hashes = data.draw(st.lists(HASHES, min_size=len(chosen), max_size=len(chosen)))
        num_cached = self.pool.cache_full_blocks([self.pool.blocks[block_id] for block_id in chosen], hashes)
        expected = 0
        for block_id, block_hash in zip(chosen, hashes, strict=True):
            if self.caching and block_id not in self.hash_of and block_hash not in self.hash_of.values():
                self.hash_of[block_id] = block_hash
                expected += 1
        assert num_cached == expected

    @rule(block_hash=HASHES)
    def get_cached_block(self, block_hash: int) -> None:
        found = self.pool.get_cached_block(block_hash)
        expected = [block_id for block_id, cached in self.hash_of.items() if cached == block_hash]
        assert (None if found is None else [found.block_id]) == (expected or None)

    @rule()
    def reset_prefix_cache(self) -> None:
        all_free = not self._held()
        assert self.pool.reset_prefix_cache() == all_free
        if all_free:
            self.hash_of.clear()

    @invariant()
    def pool_equals_model(self) -> None:
        check_block_pool(self.pool)
        assert [block.ref_count for block in self.pool.blocks] == self.ref_counts
        assert [block.block_id for block in self.pool.free_block_queue.get_all_free_blocks()] == self.free
        assert {block.block_id: block.block_hash for block in self.pool.blocks if block.block_hash is not None} == (
            self.hash_of
        )
        assert self.pool.get_usage() == 1 - len(self.free) / self.pool.num_blocks


class RequestQueueMachine(RuleBasedStateMachine):
    """The waiting queue against a list kept in policy order: FCFS (prepend = front) or priority."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = "fcfs"
        self.queue: RequestQueue = create_request_queue("fcfs")
        self.model: list[Request] = []
        self.num_added = 0

    @initialize(policy=st.sampled_from(["fcfs", "priority"]))
    def configure(self, policy: str) -> None:
        self.policy = policy
        self.queue = create_request_queue(policy)

    def _key(self, request: Request) -> tuple[int, float]:
        return (request.priority, request.arrival_time)

    def _insert(self, request: Request, front: bool) -> None:
        if self.policy == "fcfs":
            self.model.insert(0 if front else len(self.model), request)
            return
        # Stable: after every request with an equal key (the queue's insertion counter breaks ties).
        index = sum(1 for other in self.model if self._key(other) <= self._key(request))
        self.model.insert(index, request)

    @rule(priority=st.integers(0, 2), same_time=st.booleans())
    def add(self, priority: int, same_time: bool) -> None:
        arrival_time = float(self.num_added - 1 if same_time and self.num_added else self.num_added)
        request = make_request(f"r{self.num_added}", priority=priority, arrival_time=arrival_time)
        self.num_added += 1
        self.queue.add(request)
        self._insert(request, front=False)

    @rule()
    def pop_then_prepend(self) -> None:
        """Admitted, then preempted: back ahead of later arrivals (FCFS front; priority order otherwise)."""
        if not self.model:
            return
        request = self.queue.pop()
        assert request is self.model.pop(0)
        self.queue.prepend(request)
        self._insert(request, front=True)

    @rule()
    def pop(self) -> None:
        if self.model:
            assert self.queue.pop() is self.model.pop(0)

    @rule(index=st.integers(0, 20))
    def remove(self, index: int) -> None:
        if self.model:
            request = self.model.pop(index % len(self.model))
            self.queue.remove(request)

    @rule(data=st.data())
    def select_victim(self, data: st.DataObject) -> None:
        running = data.draw(st.lists(st.sampled_from(self.model), min_size=1, unique_by=id)) if self.model else []
        if not running:
            return
        victim = self.queue.select_victim(running)
        if self.policy == "fcfs":
            assert victim is running[-1]
        else:
            worst = max(self._key(request) for request in running)
            assert victim is [request for request in running if self._key(request) == worst][-1]

    @invariant()
    def queue_equals_model(self) -> None:
        assert len(self.queue) == len(self.model)
        assert [request.request_id for request in self.queue] == [request.request_id for request in self.model]
        if self.model:
            assert self.queue.peek() is self.model[0]


TestBlockPoolProperties = BlockPoolMachine.TestCase
TestBlockPoolProperties.settings = SETTINGS
TestRequestQueueProperties = RequestQueueMachine.TestCase
TestRequestQueueProperties.settings = SETTINGS
