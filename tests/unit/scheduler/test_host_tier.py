"""Host tier of the KV cache: exact block ids in both pools, the hash chain across tiers, LRU, the copies."""

import pytest

from deepinfer_jax.scheduler.host_tier import HostTier, host_hit_id
from deepinfer_jax.scheduler.kv_cache_manager import KVCacheManager
from deepinfer_jax.scheduler.prefix_cache import hash_block_tokens
from deepinfer_jax.types import Request, RequestStatus, SamplingParams

PS = 4


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams())


def run(kv, r):
    """Admit `r` (lookup + allocation of the rest), 'compute' it, cache its blocks; return the hit."""
    hit, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hit)
    r.num_computed_tokens = r.num_tokens
    kv.cache_blocks(r)
    return hit


def finish(kv, r):
    r.status = RequestStatus.FINISHED_STOPPED
    kv.free(r)


def test_host_tier_lru_and_store_once():
    t = HostTier(2)
    t.store(7, b"a")
    t.store(8, b"b")
    assert t.lookup(b"a") is None  # stored this step: its copy is still in flight
    tr = t.take_transfers()
    assert tr.saves == [(7, 0), (8, 1)] and tr.loads == []
    assert t.lookup(b"a") == 0 and t.lru_order() == [0, 1]
    t.store(9, b"a")  # held already: no copy, only touched
    assert t.take_transfers().saves == [] and t.lru_order() == [1, 0]
    t.store(5, b"c")  # evicts the least recently used, b"b" in host block 1
    assert t.lookup(b"b") is None and t.block_hash(1) == b"c" and t.lru_order() == [0, 1]
    assert t.take_transfers().saves == [(5, 1)] and t.blocks_saved == 3


def test_evicted_blocks_go_to_host_and_come_back():
    # 4 usable device pages (ids 1..4), 3 host blocks. Prompt A: 9 tokens = 2 full blocks + 1 token.
    kv = KVCacheManager(num_pages=5, page_size=PS, num_host_blocks=3)
    a = req("a", range(100, 109))
    run(kv, a)
    assert kv.get_block_ids("a") == [1, 2, 3]
    ha = [hash_block_tokens(None, range(100, 104))]
    ha.append(hash_block_tokens(ha[0], range(104, 108)))
    finish(kv, a)  # free queue (head first): 4, then the tail-first hashed 3 (unhashed -> head), 2, 1
    assert kv.block_pool.free_block_ids() == [3, 4, 2, 1]
    assert kv.take_transfers().saves == []
    # B (different tokens, 13 tokens -> 4 pages) takes 3, 4, 2, 1: evicts A's block 2 then block 1.
    b = req("b", range(500, 513))
    run(kv, b)
    assert kv.get_block_ids("b") == [3, 4, 2, 1]
    tr = kv.take_transfers()
    assert tr.saves == [(2, 0), (1, 1)] and tr.loads == []
    tier = kv.host_tier
    assert tier.block_hash(0) == ha[1] and tier.block_hash(1) == ha[0]
    assert kv.prefix_cache.get(ha[0]) is None
    finish(kv, b)
    # A comes back: both blocks hit in the host tier, in chain order, as host hit ids.
    a2 = req("a2", range(100, 110))
    hit, n = kv.get_computed_blocks(a2)
    assert hit == [host_hit_id(1), host_hit_id(0)] and n == 8
    # B's free queue: [1(unhashed tail -> head)... ] pages handed out evict B's hashed blocks to the host.
    free_before = kv.block_pool.free_block_ids()
    assert kv.allocate_slots(a2, 2, hit)
    got = kv.get_block_ids("a2")
    assert got == free_before[:3]  # two fresh pages for the loads, one for the new tokens
    tr = kv.take_transfers()
    assert tr.loads == [(1, got[0]), (0, got[1])]
    assert kv.prefix_cache.get(ha[0]) == got[0] and kv.prefix_cache.get(ha[1]) == got[1]
    assert tier.hits == 8 and tier.queries == 9 + 13 + 10 and tier.blocks_loaded == 2
    # B's evicted hashed pages were saved; host blocks 0 and 1 (just hit) were touched, so block 2 went first.
    assert [h for _, h in tr.saves][0] == 2
    assert a2.num_tokens == 10 and kv.block_pool.ref_count(got[0]) == 1


def test_mixed_chain_and_fresh_blocks_miss():
    kv = KVCacheManager(num_pages=4, page_size=PS, num_host_blocks=4)  # 3 usable device pages
    a = req("a", range(8 + 1))  # 2 full blocks
    run(kv, a)
    finish(kv, a)
    assert kv.block_pool.free_block_ids() == [3, 2, 1]
    c = req("c", range(50, 54 + 1))  # 1 full block, 2 pages: takes 3 and 2 (evicts A's tail block 2)
    hit, _ = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, c.num_tokens, hit)
    # A again in the same step: its block 2's save is in flight, so the chain stops after the device hit.
    a2 = req("a2", range(9))
    assert kv.get_computed_blocks(a2) == ([1], 4)
    tr = kv.take_transfers()
    assert tr.saves == [(2, 0)]
    assert kv.get_computed_blocks(a2) == ([1, host_hit_id(0)], 8)  # head in HBM, tail on the host


def test_all_or_nothing_counts_host_hits():
    kv = KVCacheManager(num_pages=4, page_size=PS, num_host_blocks=2)
    a = req("a", range(9))
    run(kv, a)
    finish(kv, a)
    hog = req("hog", range(60, 72))  # 3 pages: evicts both of A's blocks
    run(kv, hog)
    kv.take_transfers()
    a2 = req("a2", range(9))
    hit, _ = kv.get_computed_blocks(a2)
    assert hit == [host_hit_id(1), host_hit_id(0)]
    assert not kv.allocate_slots(a2, 1, hit)  # all 3 pages held: no room for the loads
    assert kv.take_transfers().loads == [] and kv.host_tier.hits == 0


def test_needs_prefix_caching():
    with pytest.raises(ValueError, match="prefix caching"):
        KVCacheManager(num_pages=4, page_size=PS, enable_prefix_caching=False, num_host_blocks=2)


def test_preempted_request_swaps_back_from_the_host():
    """test_scheduler.py's preemption case with caching and a host tier: the victim's full pages stay cached, the
    one its preemptor takes is saved to the host, and the victim comes back from both tiers, computing only its
    last token (recompute would start at position 0)."""
    from deepinfer_jax.config import CacheConfig, SchedulerConfig
    from deepinfer_jax.scheduler.scheduler import Scheduler

    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=16),
                  CacheConfig(page_size=PS), 5, num_host_blocks=4)
    a = Request("a", list(range(100, 106)), SamplingParams(max_tokens=6))
    b = Request("b", list(range(200, 206)), SamplingParams(max_tokens=6))
    s.add_request(a)
    s.add_request(b)

    def step():
        plan = s.schedule()
        s.update_from_output(plan, {q.request_id: 7 for q in plan.seqs if q.sample})
        return plan

    for _ in range(3):
        assert not step().kv_transfers
    assert s.kv_cache_manager.get_block_ids("b") == [3, 4]
    plan = step()  # a needs a 3rd page: b is preempted, a takes b's tail page 4, which is saved to host block 0
    assert plan.preempted_ids == ["b"] and s.kv_cache_manager.get_block_ids("a") == [1, 2, 4]
    assert plan.kv_transfers.saves == [(4, 0)] and plan.kv_transfers.loads == []
    while not a.is_finished:
        step()
    plan = step()  # b: page 3 from HBM, its second page loaded from the host into a's freed page 4
    assert [(q.request_id, q.start_pos, len(q.token_ids)) for q in plan.seqs] == [("b", 8, 1)]
    assert s.kv_cache_manager.get_block_ids("b") == [3, 4, 2]
    assert plan.kv_transfers.loads == [(0, 4)] and plan.kv_transfers.saves == [(2, 1)]  # a's cached page 2 evicted
    assert b.num_preemptions == 1 and s.stats().host_tier_hits == 4
    while s.has_unfinished_requests():
        step()
    assert b.output_token_ids == [7] * 6
