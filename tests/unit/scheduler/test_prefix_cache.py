"""Prefix cache: chained hashes over full blocks, last-token rule, hits through the KV manager."""

import pytest

from deepinfer_jax.scheduler.kv_cache_manager import KVCacheManager
from deepinfer_jax.scheduler.prefix_cache import (
    PrefixCache,
    extend_block_hashes,
    hash_block_tokens,
    max_hit_blocks,
)
from deepinfer_jax.types import Request, SamplingParams

PS = 4


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams())


def run_prefill(kv, r):
    """Admit r with its prefix hit, 'compute' the whole prompt, cache the filled blocks."""
    hit, num_hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - num_hit, hit)
    r.num_computed_tokens = r.num_tokens
    kv.cache_blocks(r)
    return hit, num_hit


def test_hash_chain():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4]) and len(a) == 32
    b = hash_block_tokens(a, [5, 6, 7, 8])
    # same block contents after a different prefix -> different hash
    assert b != hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert b != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])


def test_extend_block_hashes_full_blocks_only_and_incremental():
    toks = list(range(11))
    full = extend_block_hashes([], toks, PS)
    assert len(full) == 2  # the partial third block is not hashed
    inc = extend_block_hashes([], toks[:5], PS)
    assert len(inc) == 1
    extend_block_hashes(inc, toks, PS)
    assert inc == full
    assert full[1] == hash_block_tokens(full[0], toks[4:8])
    # From a later start (the tokens of the blocks not hashed yet): the same hashes.
    tail = extend_block_hashes(full[:1], toks[4:], PS, start=4)
    assert tail == full
    assert extend_block_hashes(full[:2], toks[8:], PS, start=8) == full
    with pytest.raises(ValueError, match="start"):
        extend_block_hashes([], toks[4:], PS, start=4)  # would skip the first block
    with pytest.raises(ValueError, match="start"):
        extend_block_hashes(full[:1], toks[3:], PS, start=3)


def test_max_hit_blocks_last_token_rule():
    assert [max_hit_blocks(n, PS) for n in (0, 1, 4, 5, 8, 9)] == [0, 0, 0, 1, 1, 2]


def test_lookup_breaks_at_first_miss():
    pc = PrefixCache()
    hs = extend_block_hashes([], list(range(12)), PS)
    pc.insert(hs[0], 1)
    pc.insert(hs[2], 3)
    assert pc.lookup(hs) == [1]
    pc.insert(hs[1], 2)
    assert pc.lookup(hs) == [1, 2, 3]
    pc.remove(hs[1], 99)  # not its block: ignored
    assert pc.lookup(hs) == [1, 2, 3]
    pc.remove(hs[1], 2)
    assert pc.lookup(hs) == [1]


def test_hits_partial_blocks_and_last_token():
    kv = KVCacheManager(num_pages=32, page_size=PS)
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens
    a = req("a", prompt)
    assert run_prefill(kv, a) == ([], 0)
    blocks_a = kv.get_block_ids("a")
    assert blocks_a == [1, 2, 3]
    assert kv.block_pool.block_hash(3) is None  # partial block not cached

    b = req("b", prompt)
    hit, n = kv.get_computed_blocks(b)
    assert (hit, n) == ([1, 2], 8)
    # exactly 8 tokens: only 1 block may hit (the last token must be computed)
    assert kv.get_computed_blocks(req("c", prompt[:8])) == ([1], 4)
    assert kv.get_computed_blocks(req("d", prompt[:9])) == ([1, 2], 8)
    # extending the prompt past the partial block still hits only full blocks
    assert kv.get_computed_blocks(req("e", prompt + [1, 2, 3]))[1] == 8
    # same second-block contents after a different first block: no hit at all
    other = [0, 0, 0, 0] + prompt[4:]
    assert kv.get_computed_blocks(req("f", other)) == ([], 0)
    # first block differs in one token: no hit
    assert kv.get_computed_blocks(req("g", [101] + prompt[1:]))[1] == 0


def test_hit_touches_blocks_and_survives_owner_free():
    kv = KVCacheManager(num_pages=16, page_size=PS)
    prompt = list(range(9))
    a = req("a", prompt)
    run_prefill(kv, a)
    b = req("b", prompt)
    hit, n = run_prefill(kv, b)
    assert hit == [1, 2] and n == 8
    assert kv.get_block_ids("b")[:2] == [1, 2] and len(kv.get_block_ids("b")) == 3
    assert kv.block_pool.ref_count(1) == 2 and kv.block_pool.ref_count(2) == 2
    a.status = a.status.FINISHED_STOPPED
    kv.free(a)
    assert kv.block_pool.ref_count(1) == 1
    assert 1 not in kv.block_pool.free_block_ids()
    assert kv.prefix_cache_queries == 18 and kv.prefix_cache_hits == 8


def test_hit_on_free_cached_blocks_revives_them():
    kv = KVCacheManager(num_pages=8, page_size=PS)  # 7 usable
    prompt = list(range(12))
    a = req("a", prompt)
    run_prefill(kv, a)  # blocks [1, 2, 3], all full; 1 and 2 are hit-able (3 holds the last token)
    a.status = a.status.FINISHED_LENGTH
    kv.free(a)
    assert kv.block_pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]
    b = req("b", prompt)
    hit, n = kv.get_computed_blocks(b)
    assert (hit, n) == ([1, 2], 8)
    assert kv.allocate_slots(b, 4, hit)
    # hits left the free queue; the new block came from the head
    assert kv.get_block_ids("b") == [1, 2, 4]
    assert kv.block_pool.free_block_ids() == [5, 6, 7, 3]


def test_blocks_cached_only_after_compute_and_evicted_on_reuse():
    kv = KVCacheManager(num_pages=4, page_size=PS)  # 3 usable
    a = req("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    assert len(kv.prefix_cache) == 0  # nothing computed yet
    a.num_computed_tokens = 4
    kv.cache_blocks(a)
    assert len(kv.prefix_cache) == 1
    a.num_computed_tokens = 8
    kv.cache_blocks(a)
    assert len(kv.prefix_cache) == 2
    a.status = a.status.FINISHED_STOPPED
    kv.free(a)
    c = req("c", [50] * 12)
    assert kv.allocate_slots(c, 12)  # needs all 3 blocks: both cached ones get evicted
    assert len(kv.prefix_cache) == 0
    assert kv.get_computed_blocks(req("x", list(range(8)) + [1])) == ([], 0)


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_pages=8, page_size=PS, enable_prefix_caching=False)
    a = req("a", list(range(9)))
    run_prefill(kv, a)
    assert kv.get_computed_blocks(req("b", list(range(9)))) == ([], 0)
    assert kv.prefix_cache_queries == 0
