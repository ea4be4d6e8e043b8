"""KVCacheManager: slot allocation, all-or-nothing failure, reverse-order free, usage."""

import pytest

from deepinfer_jax.scheduler.kv_cache_manager import KVCacheManager
from deepinfer_jax.types import Request, RequestStatus, SamplingParams

PS = 4


def req(rid, n):
    return Request(rid, list(range(1000, 1000 + n)), SamplingParams())


def test_allocate_grows_by_pages():
    kv = KVCacheManager(num_pages=10, page_size=PS)
    r = req("r", 6)
    assert kv.allocate_slots(r, 3)
    assert kv.get_block_ids("r") == [1]
    r.num_computed_tokens = 3
    assert kv.allocate_slots(r, 1)  # position 3 still fits page 1
    assert kv.get_block_ids("r") == [1]
    r.num_computed_tokens = 4
    assert kv.allocate_slots(r, 2)
    assert kv.get_block_ids("r") == [1, 2]
    assert kv.usage == pytest.approx(2 / 9)


def test_block_list_generation_names_a_lifetime():
    """Equal generations mean the later list is the earlier one grown at its end; a list freed and allocated
    again (preemption) gets a new one, as does every other request's, in every manager."""
    kv, other = KVCacheManager(num_pages=10, page_size=PS), KVCacheManager(num_pages=10, page_size=PS)
    r, s = req("r", 12), req("s", 4)
    assert kv.block_list_generation("r") == 0
    assert kv.allocate_slots(r, 3)
    g = kv.block_list_generation("r")
    first = list(kv.get_block_ids("r"))
    r.num_computed_tokens = 3
    assert kv.allocate_slots(r, 6)
    assert kv.block_list_generation("r") == g and kv.get_block_ids("r")[: len(first)] == first
    assert kv.allocate_slots(s, 4) and other.allocate_slots(req("r", 4), 4)
    assert len({g, kv.block_list_generation("s"), other.block_list_generation("r")}) == 3
    kv.free(r)
    assert kv.block_list_generation("r") == 0
    r.num_computed_tokens = 0
    assert kv.allocate_slots(r, 5)
    assert kv.block_list_generation("r") not in (0, g)


def test_cannot_schedule_unknown_tokens():
    kv = KVCacheManager(num_pages=10, page_size=PS)
    r = req("r", 6)
    with pytest.raises(ValueError):
        kv.allocate_slots(r, 7)
    with pytest.raises(ValueError):
        kv.allocate_slots(r, 0)


def test_failure_changes_nothing():
    kv = KVCacheManager(num_pages=4, page_size=PS)  # 3 usable
    a, b = req("a", 8), req("b", 8)
    assert kv.allocate_slots(a, 8)
    free_before = kv.block_pool.free_block_ids()
    assert not kv.allocate_slots(b, 8)
    assert kv.get_block_ids("b") == [] and kv.block_pool.free_block_ids() == free_before
    assert kv.prefix_cache_queries == 8  # only the successful first allocation counted
    assert kv.allocate_slots(b, 4)
    assert kv.get_block_ids("b") == [3]


def test_hit_counts_against_free_blocks():
    kv = KVCacheManager(num_pages=4, page_size=PS)  # 3 usable
    a = req("a", 9)
    assert kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.cache_blocks(a)
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    b = Request("b", a.prompt_token_ids + [7, 7, 7, 7, 7, 7, 7], SamplingParams())  # 16 tokens
    hit, n = kv.get_computed_blocks(b)
    assert n == 8 and len(hit) == 2
    # hits take 2 of the 3 free blocks, the remaining 8 tokens need 2 more: not enough
    assert not kv.allocate_slots(b, 8, hit)
    assert kv.block_pool.num_free_blocks == 3 and kv.block_pool.ref_count(hit[0]) == 0
    assert kv.allocate_slots(b, 4, hit)


def test_free_reverse_order_and_hashes_kept_across_preemption():
    kv = KVCacheManager(num_pages=8, page_size=PS)
    r = req("r", 14)
    assert kv.allocate_slots(r, 14)
    r.num_computed_tokens = 14
    kv.cache_blocks(r)
    assert kv.get_block_ids("r") == [1, 2, 3, 4]
    r.status = RequestStatus.PREEMPTED
    kv.free(r)
    # partial block 4 to the head; full blocks appended tail-first
    assert kv.block_pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]
    assert kv.get_block_ids("r") == [] and "r" in kv._hashes
    r.num_computed_tokens = 0
    assert kv.get_computed_blocks(r) == ([1, 2, 3], 12)
    r.status = RequestStatus.FINISHED_ABORTED
    kv.free(r)
    assert "r" not in kv._hashes
    assert kv.usage == 0.0
