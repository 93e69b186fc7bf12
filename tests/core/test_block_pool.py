"""BlockPool and FreeBlockQueue: exact block ids, ref counts, free-queue order and eviction."""

import pytest

from folio.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]


def test_free_queue_popleft_append_remove_middle() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])  # middle
    queue.remove(blocks[4])  # tail
    assert queue.popleft() is blocks[0]  # head
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 3]
    queue.append(blocks[0])
    queue.append(blocks[2])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 3, 0, 2]
    assert len(queue) == 4
    for expected in (1, 3, 0, 2):
        assert queue.popleft().block_id == expected
    assert len(queue) == 0
    with pytest.raises(ValueError):
        queue.popleft()
    queue.append(blocks[4])  # empty -> one element: head and tail are the same block
    assert [b.block_id for b in queue.get_all_free_blocks()] == [4]
    assert blocks[4].prev_free_block is None and blocks[4].next_free_block is None


def test_get_new_blocks_in_id_order_with_ref_count_one() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]  # block 0 is usable: nothing reserved
    assert [b.ref_count for b in blocks] == [1, 1, 1]
    assert pool.get_num_free_blocks() == 3
    assert pool.get_usage() == pytest.approx(0.5)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert pool.get_num_free_blocks() == 3  # a failed request changes nothing


def test_free_appends_to_tail_in_given_order() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)  # free queue now [3, 4]
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 2, 1, 0]
    assert [b.ref_count for b in blocks] == [0, 0, 0]
    assert [b.block_id for b in pool.get_new_blocks(3)] == [3, 4, 2]  # LRU: the least recently freed first
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([blocks[0], blocks[0]])


def test_shared_block_returns_to_free_queue_only_at_zero() -> None:
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_count == 2
    pool.free_blocks([block])
    assert block.ref_count == 1
    assert free_ids(pool) == [1, 2]
    pool.free_blocks([block])
    assert free_ids(pool) == [1, 2, 0]


def test_cached_free_block_is_revived_by_touch() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    assert pool.cache_full_blocks(blocks, [111, 222]) == 2
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [2, 3, 1, 0]
    assert pool.get_cached_block(111) is blocks[0]  # freed but still findable
    pool.touch([blocks[0]])  # a hit revives it: out of the free queue, ref_count 1
    assert blocks[0].ref_count == 1
    assert free_ids(pool) == [2, 3, 1]
    assert blocks[0].block_hash == 111


def test_reuse_evicts_hash() -> None:
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [111, 222])
    pool.free_blocks(reversed(blocks))  # free queue [1, 0]
    (reused,) = pool.get_new_blocks(1)
    assert reused.block_id == 1
    assert reused.block_hash is None
    assert pool.get_cached_block(222) is None  # evicted
    assert pool.get_cached_block(111) is blocks[0]  # untouched


def test_same_hash_keeps_first_block() -> None:
    pool = BlockPool(3)
    first, second = pool.get_new_blocks(2)
    assert pool.cache_full_blocks([first], [7]) == 1
    assert pool.cache_full_blocks([second], [7]) == 0
    assert pool.get_cached_block(7) is first
    assert second.block_hash is None
    pool.free_blocks([second, first])
    pool.get_new_blocks(2)  # pops 2, then 1 (second): evicting it must not drop the map entry of first
    assert pool.get_cached_block(7) is first
    assert pool.cache_full_blocks([first], [7]) == 0  # already cached: no-op


def test_caching_disabled_caches_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    assert pool.cache_full_blocks(blocks, [1, 2]) == 0
    assert pool.get_cached_block(1) is None


def test_reset_prefix_cache_only_when_all_free() -> None:
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [5])
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(5) is None
    assert blocks[0].block_hash is None
