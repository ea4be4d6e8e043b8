"""BlockPool: exact block ids, ref counts, LRU free queue and eviction of cached blocks."""

import pytest

from deepinfer_jax.scheduler.block_pool import NULL_BLOCK_ID, BlockPool
from deepinfer_jax.scheduler.prefix_cache import PrefixCache, hash_block_tokens


def h(i):
    return hash_block_tokens(None, [i])


def test_initial_state_and_null_block():
    pool = BlockPool(6)
    assert NULL_BLOCK_ID == 0
    assert pool.free_block_ids() == [1, 2, 3, 4, 5]
    assert pool.num_usable_blocks == 5 and pool.num_free_blocks == 5 and pool.usage == 0.0
    assert pool.get_new_blocks(5) == [1, 2, 3, 4, 5]  # block 0 is never handed out
    assert pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        pool.free_blocks([0])
    with pytest.raises(ValueError):
        pool.touch([0])
    with pytest.raises(ValueError):
        BlockPool(1)


def test_allocate_free_order_and_refcounts():
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)
    assert a == [1, 2, 3]
    assert [pool.ref_count(b) for b in a] == [1, 1, 1]
    assert pool.free_block_ids() == [4, 5, 6, 7]
    pool.free_blocks(reversed(a))  # unhashed blocks go to the head
    assert pool.free_block_ids()[:3] == [1, 2, 3]
    assert sorted(pool.free_block_ids()) == [1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([1])


def test_hashed_blocks_go_to_tail_tail_of_sequence_evicted_first():
    cache = PrefixCache()
    pool = BlockPool(8, cache)
    seq = pool.get_new_blocks(4)  # [1, 2, 3, 4]; blocks 1..3 full and cached, 4 partial
    for i, b in enumerate(seq[:3]):
        assert pool.cache_block(b, h(i))
    pool.free_blocks(reversed(seq))
    # 4 (unhashed) at the head, then untouched 5..7, then 3, 2, 1 (the sequence's tail first)
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]
    assert len(cache) == 3
    assert pool.get_new_blocks(4) == [4, 5, 6, 7]
    assert len(cache) == 3  # nothing cached evicted yet
    assert pool.get_new_blocks(1) == [3]  # evicts the deepest block of the chain first
    assert cache.get(h(2)) is None and pool.block_hash(3) is None
    assert cache.get(h(0)) == 1 and cache.get(h(1)) == 2


def test_touch_revives_cached_free_block():
    cache = PrefixCache()
    pool = BlockPool(5, cache)
    b = pool.get_new_blocks(2)
    pool.cache_block(b[0], h(0))
    pool.free_blocks(reversed(b))
    assert pool.free_block_ids() == [2, 3, 4, 1]
    pool.touch([1])
    assert pool.ref_count(1) == 1 and 1 not in pool.free_block_ids()
    assert cache.get(h(0)) == 1 and pool.num_free_blocks == 3
    pool.touch([1])
    assert pool.ref_count(1) == 2
    pool.free_blocks([1])
    assert 1 not in pool.free_block_ids()
    pool.free_blocks([1])
    assert pool.free_block_ids()[-1] == 1 and pool.block_hash(1) == h(0)


def test_cache_block_rules():
    cache = PrefixCache()
    pool = BlockPool(5, cache)
    b1, b2 = pool.get_new_blocks(2)
    assert pool.cache_block(b1, h(0))
    assert not pool.cache_block(b2, h(0))  # hash already held by another block: b2 stays private
    assert pool.block_hash(b2) is None and cache.get(h(0)) == b1
    assert not pool.cache_block(b1, h(1))  # already hashed
    pool.free_blocks([b2])
    with pytest.raises(ValueError):
        pool.cache_block(b2, h(5))
    assert not BlockPool(3).cache_block(1, h(0))  # caching off


def test_reset_prefix_cache():
    cache = PrefixCache()
    pool = BlockPool(4, cache)
    b = pool.get_new_blocks(1)
    pool.cache_block(b[0], h(0))
    assert not pool.reset_prefix_cache()
    pool.free_blocks(b)
    assert pool.reset_prefix_cache()
    assert len(cache) == 0 and pool.block_hash(b[0]) is None
