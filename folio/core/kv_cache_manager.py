"""Per-request KV block lists on top of the BlockPool: prefix hits, slot allocation, free, fork and copy-on-write.

Block i of a request holds the K/V of its token positions i * block_size .. (i + 1) * block_size - 1.
A block may be shared (ref_count > 1) by requests whose tokens agree over it: through prefix-cache hits (always
full blocks, never written again) or through ``fork`` (n > 1 siblings share the parent's prompt blocks, possibly
a partial last block). Before a request writes into a shared block, ``allocate_slots`` gives it a private copy
(copy-on-write): a fresh block, a copy plan (src, dst) for the worker and a replacement (index, new id).

Blocks enter the prefix cache when the step that computes them is planned (``cache_scheduled_blocks``, as vLLM's
``allocate_slots`` caches them): a request admitted later in the same ``schedule()`` hits them instead of computing
them again (a burst of prompts sharing a system prompt computes it once, not once per request). That is sound
because the scheduler calls it only once no request of the step can be taken out of it again (after its running
loop, whose preemptions unschedule requests), every attention backend writes the whole step's K/V before any
attention reads the cache (``AttentionBackend.forward``), and steps run in order, so a hit in a later step reads
them after they were written too. A request whose blocks wait for loads that may fail (disk, received blocks)
caches its blocks only after the step that loaded them answered (``cache_computed_blocks``, called from
``Scheduler.update_from_output``): a failed load leaves its blocks unwritten.

With a host tier (``num_host_blocks`` > 0, core/offload.py) a cached device block about to be reused is stored
there first, ``get_computed_blocks`` continues the chain there (the hits are loaded into fresh device blocks), and
``swap_out`` moves a preempted request's blocks there; ``take_kv_plans`` hands the step's copies to the scheduler.
With a disk tier under it (``num_disk_blocks`` > 0, core/disk_tier.py) a cached host block about to be reused is
written to disk first, the chain continues block by block in the host tier or else on disk (disk hits are loaded
straight into fresh device blocks), and ``take_disk_plans`` hands the step's file operations to the scheduler.
With a store of blocks received from a prefill instance (``remote_kv_store``, core/remote_kv.py) the chain goes on
there too (core/lower_tiers.py), and ``take_remote_loads`` hands the step's loads of received bytes to the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from folio.core.block_pool import BlockPool, KVCacheBlock
from folio.core.disk_tier import DiskKVTier
from folio.core.lower_tiers import LowerHit, LowerTiers
from folio.core.offload import HostKVTier
from folio.core.remote_kv import RemoteKVStore, RemoteKVTier
from folio.core.sched_output import KVDiskPlans, RemoteLoad
from folio.core.spec_decode import NO_LOOKAHEAD, Lookahead
from folio.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the number of blocks of size b that a tokens need."""
    return -(-a // b)


@dataclass
class AllocationResult:
    """What one ``allocate_slots`` call changed in a request's block list (the worker applies the same diff)."""

    new_block_ids: list[int] = field(default_factory=list)  # appended to the block list (prefix hits first)
    replaced_block_ids: list[tuple[int, int]] = field(default_factory=list)  # (index, new block id), copy-on-write
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src block id, dst block id), copy-on-write
    num_kept_block_ids: int | None = None  # set after ``free_blocks_past``: the worker cuts its table to this first


class KVCacheManager:
    """Maps request ids to their ordered KV block lists and keeps prefix-cache statistics (in tokens)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        num_disk_blocks: int = 0,
        disk_block_hashes: Sequence[int] = (),
        lookahead: Lookahead = NO_LOOKAHEAD,
        remote_kv_store: RemoteKVStore | None = None,
    ) -> None:
        """``disk_block_hashes``: the hashes whose files the disk tier's directory holds at start, oldest first.
        ``lookahead``: slots past the scheduled tokens that a draft model writes in the same step (core/spec_decode).
        ``remote_kv_store``: blocks received from a prefill instance (a consumer's kv_transfer_config)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.lookahead = lookahead
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Per request: how many leading blocks were already offered to the prefix cache (so none is re-offered).
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up (request.num_tokens per get_computed_blocks call)
        self.prefix_cache_hits = 0  # of which found in the cache
        self.num_cow_copies = 0  # blocks copied before a write because another request shared them
        self._num_kept_blocks: dict[str, int] = {}  # request id -> table length after free_blocks_past, until sent
        # Requests with disk or remote loads planned whose step has not answered yet: not cached at schedule time.
        self._loads_in_doubt: set[str] = set()
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.host_tier = HostKVTier(num_host_blocks) if num_host_blocks > 0 else None
        if self.host_tier is not None and enable_prefix_caching:
            self.block_pool.on_evict = self.host_tier.store_evicted
        if num_disk_blocks < 0:
            raise ValueError(f"num_disk_blocks must be >= 0, got {num_disk_blocks}")
        if num_disk_blocks > 0 and self.host_tier is None:
            raise ValueError("a disk KV tier needs a host KV tier under the device (num_host_blocks > 0)")
        self.disk_tier = DiskKVTier(num_disk_blocks, disk_block_hashes) if num_disk_blocks > 0 else None
        self.remote_tier = RemoteKVTier(remote_kv_store) if remote_kv_store is not None else None
        self.lower_tiers = LowerTiers(self.host_tier, self.disk_tier, self.remote_tier)
        if self.host_tier is not None and self.disk_tier is not None and enable_prefix_caching:
            self.host_tier.pool.on_evict = self.lower_tiers.store_to_disk
        # (request id, hits past the device's) found by the last get_computed_blocks, for the allocate_slots that
        # follows it: a host block, a block hash held by the disk tier, or a received block.
        self._lower_hits: tuple[str, list[LowerHit]] | None = None

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of KV blocks in use, in [0, 1] (free blocks holding cached K/V count as free)."""
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref_count >= 1 (held by some request)."""
        return self.block_pool.num_blocks - self.block_pool.get_num_free_blocks()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's whole block table, as ids (empty if it holds no blocks)."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest prefix of ``request``'s full blocks found in the cache, and the number of tokens it covers.

        Capped so that at least one token is recomputed (the model needs the last position's logits):
        hit tokens <= num_tokens - 1, in whole blocks. Example (block_size 4): 8 tokens with both blocks cached ->
        1 block, 4 tokens. Changes no ref count (``allocate_slots`` takes the references); counts the query.
        The host tier (or, block by block where it misses, the disk tier, then the received blocks) continues the
        chain after the device blocks: those hits count in the tokens (not in the blocks) and ``allocate_slots`` loads
        them. A swapped-out request gets ([], its num_computed_tokens).
        """
        self._lower_hits = None
        swapped = self.host_tier.num_swapped_blocks(request.request_id) if self.host_tier is not None else None
        if swapped is not None:
            return [], request.num_computed_tokens
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed (vLLM skips the cache too)
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        computed_blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_num_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed_blocks.append(block)
        num_computed_tokens = len(computed_blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_computed_tokens
        if self.lower_tiers:
            lower_hits = self.lower_tiers.find_chain(request.block_hashes[len(computed_blocks) : max_num_blocks])
            self.lower_tiers.record_query(request.num_tokens - num_computed_tokens, len(lower_hits) * self.block_size)
            self._lower_hits = (request.request_id, lower_hits)
            num_computed_tokens += len(lower_hits) * self.block_size
        return computed_blocks, num_computed_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
    ) -> AllocationResult | None:
        """Give ``request`` blocks for ``num_new_tokens`` more tokens after its computed ones (and prefix hits).

        The request will write positions c .. c + num_new_tokens - 1, c = num_computed_tokens + num_new_computed_tokens.
        Needed blocks: the fresh ones to cover c + num_new_tokens tokens (and the lookahead slots after them), plus
        one private copy per shared block (ref_count > 1) among those positions. Hit blocks that are free count
        against the free blocks, since reviving them takes them out of the free queue.
        Returns None and changes nothing if that many blocks are not free. Otherwise takes a reference on the hit
        blocks, applies copy-on-write (fresh blocks taken first for copies, then for the tail) and returns the diff.
        Host, disk and remote tiers: the first fresh blocks receive the loads of the hits of the preceding
        ``get_computed_blocks`` (its tokens beyond ``new_computed_blocks``) or of a swapped-out request's blocks.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        req_id = request.request_id
        lower_hits, self._lower_hits = self._lower_hits, None
        num_lower_hit_tokens = num_new_computed_tokens - len(new_computed_blocks) * self.block_size
        if num_lower_hit_tokens > 0 and (lower_hits is None or lower_hits[0] != req_id):
            raise ValueError(f"{num_lower_hit_tokens} computed tokens of {req_id} beyond its blocks, without hits")
        loaded = lower_hits[1][: num_lower_hit_tokens // self.block_size] if lower_hits and num_lower_hit_tokens else []
        req_blocks = self.req_to_blocks.get(req_id, [])
        if new_computed_blocks and req_blocks:
            raise ValueError(f"prefix hits for {req_id}, which already holds blocks")
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_slots = self.lookahead.num_slots(num_computed_tokens, num_new_tokens)
        num_required_blocks = cdiv(num_slots, self.block_size)
        num_fresh_blocks = max(0, num_required_blocks - len(req_blocks) - len(new_computed_blocks))
        cow_indices = self._shared_blocks_to_write(req_blocks, num_computed_tokens, num_new_tokens)
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_count == 0)
        if num_fresh_blocks + len(cow_indices) > self.get_num_free_blocks() - num_evictable_hits:
            return None

        self.block_pool.touch(new_computed_blocks)
        self.lower_tiers.pin(loaded)  # before taking device blocks: their eviction stores must not reuse or drop these
        result = AllocationResult(num_kept_block_ids=self._num_kept_blocks.pop(req_id, None))
        for index in cow_indices:
            old_block = req_blocks[index]
            (new_block,) = self.block_pool.get_new_blocks(1)
            req_blocks[index] = new_block
            self.block_pool.free_blocks([old_block])  # ref_count >= 1 left: the other holders keep it
            result.block_copies.append((old_block.block_id, new_block.block_id))
            self.num_cow_copies += 1
            result.replaced_block_ids.append((index, new_block.block_id))
        fresh_blocks = self.block_pool.get_new_blocks(num_fresh_blocks)
        appended = [*new_computed_blocks, *fresh_blocks]
        req_blocks.extend(appended)
        self.lower_tiers.plan_loads(req_id, loaded, [block.block_id for block in fresh_blocks])
        if any(not isinstance(hit, KVCacheBlock) for hit in loaded):
            self._loads_in_doubt.add(req_id)
        result.new_block_ids = [block.block_id for block in appended]
        self.req_to_blocks[req_id] = req_blocks
        # Prefix hits are cached already: the cache bookkeeping starts after them.
        self._num_cached_blocks[req_id] = self._num_cached_blocks.get(req_id, 0) + len(new_computed_blocks)
        return result

    def _shared_blocks_to_write(self, req_blocks: list[KVCacheBlock], start: int, num_tokens: int) -> list[int]:
        """Indices of the request's existing blocks that positions start .. start + num_tokens - 1 write and that
        another request also holds. Example (block_size 4): start 7, 2 tokens -> blocks 1 and 2 are written."""
        if num_tokens == 0:
            return []
        first_index = start // self.block_size
        last_index = min((start + num_tokens - 1) // self.block_size, len(req_blocks) - 1)
        return [i for i in range(first_index, last_index + 1) if req_blocks[i].ref_count > 1]

    def cache_scheduled_blocks(self, request: Request, num_scheduled_tokens: int) -> None:
        """Offer the full blocks that this step's ``num_scheduled_tokens`` of ``request`` complete to the prefix
        cache now, at schedule time (see the module docstring for why that is sound and when the scheduler may call
        it). Drafts past the request's known tokens are never cached; nor are the blocks of a request whose loads
        may still fail."""
        if request.request_id in self._loads_in_doubt:
            return
        num_tokens = min(request.num_computed_tokens + num_scheduled_tokens, request.num_tokens)
        self._cache_blocks(request, num_tokens)

    def has_loads_in_doubt(self, request_id: str) -> bool:
        """Whether the request's disk or remote loads are still unanswered (its blocks may be unwritten)."""
        return request_id in self._loads_in_doubt

    def cache_computed_blocks(self, request: Request) -> None:
        """Offer the request's full, computed blocks (K/V written by a finished forward) to the prefix cache.

        Call after the step that advanced ``request.num_computed_tokens`` ran, with block hashes up to date: its
        loads, if any, are no longer in doubt.
        """
        self._loads_in_doubt.discard(request.request_id)
        self._cache_blocks(request, request.num_computed_tokens)

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the request's full blocks among its first ``num_tokens`` positions (those not offered before)."""
        if not self.enable_prefix_caching:
            return
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id)
        if req_blocks is None:
            return
        num_full_blocks = min(num_tokens // self.block_size, len(request.block_hashes), len(req_blocks))
        num_cached_blocks = self._num_cached_blocks.get(req_id, 0)
        if num_full_blocks <= num_cached_blocks:
            return
        self.block_pool.cache_full_blocks(
            req_blocks[num_cached_blocks:num_full_blocks], request.block_hashes[num_cached_blocks:num_full_blocks]
        )
        self._num_cached_blocks[req_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Drop the request's references, last block first, so that its tail blocks are evicted before its head.

        The head (a shared prompt prefix, e.g. a system prompt) is the part most likely to be hit again.
        No-op for a request holding no blocks.
        """
        self._free_device_blocks(request)
        if self.host_tier is not None:
            self.host_tier.free_swapped(request.request_id)

    def free_blocks_past(self, request: Request, num_blocks: int) -> int:
        """Free the request's blocks after its first ``num_blocks`` (never cached: the slots of rejected drafts), last
        first; returns how many. Its next AllocationResult says to cut the worker's block table to that length."""
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        tail = req_blocks[num_blocks:]
        if tail:
            del req_blocks[num_blocks:]
            self.block_pool.free_blocks(reversed(tail))
            self._num_kept_blocks[request.request_id] = num_blocks
        return len(tail)

    def _free_device_blocks(self, request: Request) -> None:
        self._num_cached_blocks.pop(request.request_id, None)
        self._loads_in_doubt.discard(request.request_id)
        self._num_kept_blocks.pop(request.request_id, None)
        req_blocks = self.req_to_blocks.pop(request.request_id, None)
        if req_blocks:
            self.block_pool.free_blocks(reversed(req_blocks))

    def swap_out(self, request: Request) -> bool:
        """Move the request's computed blocks (a partial last one included) to the host tier and free its device
        blocks; num_computed_tokens stays. False (nothing changed) without a host tier, with nothing computed,
        or when the host tier cannot take every block: the caller recomputes instead."""
        num_blocks = cdiv(request.num_computed_tokens, self.block_size)
        if self.host_tier is None or num_blocks == 0:
            return False
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        num_full_blocks = request.num_computed_tokens // self.block_size if self.enable_prefix_caching else 0
        hashes = request.block_hashes[:num_full_blocks]
        block_hashes: list[int | None] = [*hashes, *[None] * (num_blocks - len(hashes))]
        block_ids = [block.block_id for block in req_blocks[:num_blocks]]
        if not self.host_tier.swap_out(request.request_id, block_ids, block_hashes):
            return False
        self._free_device_blocks(request)
        return True

    def plan_disk_flush(self) -> None:
        """Shutdown: plan disk stores of every cached block of the host tier, then of the device (a hash on disk
        already becomes the most recently used), so that a restarted engine finds all of them warm. Oldest first:
        when they do not all fit, the disk tier keeps the most recent. Take the plans with ``take_disk_plans``."""
        if self.disk_tier is None or self.host_tier is None or not self.enable_prefix_caching:
            return
        self.disk_tier.store_cached_blocks(self.host_tier.pool, from_device=False)
        self.disk_tier.store_cached_blocks(self.block_pool, from_device=True)

    def take_disk_plans(self) -> KVDiskPlans:
        """The disk tier's plans since the last call, for this step's SchedulerOutput; unpins its loads."""
        return self.disk_tier.take_plans() if self.disk_tier is not None else KVDiskPlans()

    def forget_disk_blocks(self, block_hashes: Sequence[int]) -> None:
        """The worker could not load these from disk: the disk tier drops them."""
        if self.disk_tier is not None:
            self.disk_tier.forget(block_hashes)

    def take_remote_loads(self) -> list[RemoteLoad]:
        """The loads of received blocks planned since the last call, for this step's SchedulerOutput."""
        return self.remote_tier.take_plans() if self.remote_tier is not None else []

    def is_swapped_out(self, request_id: str) -> bool:
        return self.host_tier is not None and self.host_tier.num_swapped_blocks(request_id) is not None

    def take_kv_plans(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The (stores, loads) planned since the last call, for this step's SchedulerOutput; unpins the loads."""
        if self.host_tier is None:
            return [], []
        return self.host_tier.take_plans()

    def fork(self, parent_request_id: str, child_request: Request) -> None:
        """Share the parent's blocks covering the (common) prompt with ``child_request`` (ref_count += 1 each).

        The parent's prompt must be fully scheduled (it holds blocks for all of it). The child owns no block yet.
        A later write by either into a shared block goes through copy-on-write in ``allocate_slots``.
        """
        child_id = child_request.request_id
        if child_id in self.req_to_blocks:
            raise ValueError(f"cannot fork into {child_id}: it already holds blocks")
        parent_blocks = self.req_to_blocks.get(parent_request_id, [])
        num_prompt_blocks = cdiv(child_request.num_prompt_tokens, self.block_size)
        if len(parent_blocks) < num_prompt_blocks:
            raise ValueError(f"parent {parent_request_id} holds {len(parent_blocks)} < {num_prompt_blocks} blocks")
        shared_blocks = parent_blocks[:num_prompt_blocks]
        self.block_pool.touch(shared_blocks)
        self.req_to_blocks[child_id] = list(shared_blocks)
        self._num_cached_blocks[child_id] = min(self._num_cached_blocks.get(parent_request_id, 0), num_prompt_blocks)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes, in every tier; only possible while no block is in use. Returns success."""
        if self.host_tier is not None and self.host_tier.usage > 0:
            return False
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.host_tier is not None and not self.host_tier.reset_prefix_cache():
            return False
        return self.disk_tier is None or self.disk_tier.reset()

    def find_leaks(self) -> list[str]:
        """Problems that mean blocks leaked; empty once every request ended: all blocks free, every ref_count 0."""
        problems = []
        if self.req_to_blocks:
            problems.append(f"requests still hold blocks: {sorted(self.req_to_blocks)}")
        problems.extend(self.block_pool.find_leaks())
        if self.host_tier is not None:
            problems.extend(f"host tier: {problem}" for problem in self.host_tier.find_leaks())
        if self.disk_tier is not None:
            problems.extend(f"disk tier: {problem}" for problem in self.disk_tier.find_leaks())
        if self.remote_tier is not None:
            problems.extend(f"remote tier: {problem}" for problem in self.remote_tier.find_leaks())
        return problems

    def assert_no_leaks(self) -> None:
        """Raise AssertionError listing the leaks (see ``find_leaks``); not stripped by ``python -O``."""
        problems = self.find_leaks()
        if problems:
            raise AssertionError("KV block leak: " + "; ".join(problems))
