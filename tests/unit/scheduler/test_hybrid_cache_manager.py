"""HybridKVCacheManager: per-group page tables, exact page counts per group, windowed groups giving pages behind
their window back (null in the table), all-or-nothing over pools, prefix hits on every compressed group's page
boundary, and the scheduler over it (preemption frees every group)."""

import pytest

from deepinfer_jax.config import CacheConfig, SchedulerConfig
from deepinfer_jax.config_v4 import CacheGroup, CachePools, V4Config, v4_cache_pools
from deepinfer_jax.scheduler.block_pool import NULL_BLOCK_ID as N
from deepinfer_jax.scheduler.hybrid_cache_manager import HybridKVCacheManager
from deepinfer_jax.scheduler.scheduler import Scheduler
from deepinfer_jax.types import Request, RequestStatus, SamplingParams

PS = 4
# sliding (window 8), csa (a row per 4 tokens), csa_state (window 8), hca (a row per 8 tokens)
GROUPS = (CacheGroup("sliding", (0, 1, 2), 8, 1, 8), CacheGroup("csa", (1,), 12, 4),
          CacheGroup("csa_state", (1,), 16, 1, 8), CacheGroup("hca", (0,), 8, 8))


def pools(*pages):
    return CachePools(GROUPS, (0, 1, 2, 3), pages, PS)


def req(rid, n, base=1000):
    return Request(rid, list(range(base, base + n)), SamplingParams())


def ids(kv, rid):
    return [list(b) for b in kv.group_block_ids(rid)]


def free_counts(kv):
    return [p.num_free_blocks for p in kv.pools]


def test_pages_per_group_and_window_release():
    kv = HybridKVCacheManager(pools(20, 6, 20, 6))
    r = req("r", 40)
    assert kv.allocate_slots(r, 15)  # 15 tokens: 4 token pages, 3 csa rows (1 page), 1 hca row (1 page)
    assert [len(b) for b in ids(kv, "r")] == [4, 1, 4, 1]
    r.num_computed_tokens = 15
    before = free_counts(kv)
    assert kv.allocate_slots(r, 1)  # token 15 reads positions 8..15: pages 0 and 1 of the windowed groups go back
    sliding, csa, state, hca = ids(kv, "r")
    assert sliding == [N, N] + sliding[2:] and state == [N, N] + state[2:] and N not in sliding[2:] + state[2:]
    assert [len(b) for b in ids(kv, "r")] == [4, 1, 4, 1]  # it closes csa row 3 and hca row 1: same pages
    assert free_counts(kv) == [before[0] + 2, before[1], before[2] + 2, before[3]]
    r.num_computed_tokens = 16
    assert kv.allocate_slots(r, 1)  # row 4 of csa (tokens 16..19) is not closed yet: no new csa page
    assert [len(b) for b in ids(kv, "r")] == [5, 1, 5, 1] and free_counts(kv)[0] == before[0] + 1
    r.num_computed_tokens = 17
    assert kv.allocate_slots(r, 23)  # up to 40 tokens: 10 rows of csa (3 pages), 5 of hca (2 pages)
    assert [len(b) for b in ids(kv, "r")] == [10, 3, 10, 2]
    assert ids(kv, "r")[0][:2] == [N, N]  # window of token 17 starts at 10: page 2 is still live
    r.num_computed_tokens = 40
    kv.free(r)
    assert kv.usage == 0.0 and free_counts(kv) == [19, 5, 19, 5]


def test_a_sequence_holds_its_window_whatever_its_length():
    kv = HybridKVCacheManager(pools(6, 20, 6, 20))  # 5 usable windowed pages: window 8 + a decode step
    r = req("r", 200)
    assert kv.allocate_slots(r, 1)
    for n in range(1, 200):
        r.num_computed_tokens = n
        assert kv.allocate_slots(r, 1), n
        live = [b for b in ids(kv, "r")[0] if b != N]
        assert len(live) <= 8 // PS + 1
    assert len(ids(kv, "r")[0]) == 50 and len(ids(kv, "r")[1]) == 13  # 200 tokens: 50 rows of csa


def test_all_or_nothing_over_pools():
    kv = HybridKVCacheManager(pools(20, 2, 20, 6))  # one usable csa page: 16 tokens
    a, b = req("a", 20), req("b", 20, base=2000)
    assert kv.allocate_slots(a, 16)
    before, tables = free_counts(kv), ids(kv, "a")
    assert not kv.allocate_slots(b, 4)  # b's first csa row needs a page the csa pool lacks
    assert free_counts(kv) == before and ids(kv, "b") == [[], [], [], []]
    assert kv.prefix_cache_queries == 20  # the failed first allocation counts nothing
    a.num_computed_tokens = 16
    assert not kv.allocate_slots(a, 4)  # a's second csa page too
    got = ids(kv, "a")  # the compressed tables as they were; the windows' dead pages went back regardless
    assert (got[1], got[3]) == (tables[1], tables[3]) and got[0] == [N, N] + tables[0][2:]
    assert kv.allocate_slots(b, 3)  # 3 tokens close no csa window: no csa page
    assert ids(kv, "b")[1] == []


def test_prefix_hit_ends_on_every_compressed_page_boundary():
    kv = HybridKVCacheManager(pools(40, 10, 40, 10))
    assert kv.hit_granularity == 32  # lcm(page 4, csa 4 x 4, hca 4 x 8)
    a = req("a", 70)
    assert kv.allocate_slots(a, 70)
    a.num_computed_tokens = 70
    kv.cache_blocks(a)
    a_tables = ids(kv, "a")
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    b = Request("b", a.prompt_token_ids[:67] + [5, 5], SamplingParams())  # shares 67 tokens
    hit, n = kv.get_computed_blocks(b)
    assert n == 64 and hit.num_tokens == 64  # 67 rounded down to 32s
    sliding, csa, state, hca = hit.blocks
    # token 64 reads positions 57..64: windowed pages from 14 on; compressed: all 16 csa rows, 8 hca rows
    assert list(sliding) == [N] * 14 + a_tables[0][14:16] and list(state) == [N] * 14 + a_tables[2][14:16]
    assert list(csa) == a_tables[1][:4] and list(hca) == a_tables[3][:2]
    assert kv.allocate_slots(b, 5, hit)
    assert [len(t) for t in ids(kv, "b")] == [18, 5, 18, 2] and kv.prefix_cache_hits == 64
    # a hit whose window pages were evicted falls back to the next boundary that has them all
    kv.free(b)
    c = Request("c", a.prompt_token_ids[:67] + [6, 6], SamplingParams())
    kv.pools[0].get_new_blocks(kv.pools[0].num_free_blocks)  # evicts every cached sliding page
    assert kv.get_computed_blocks(c) == (type(hit)(), 0)


def test_a_state_group_has_a_page_size_of_its_own():
    """csa_state's pages of 2 rows (page_size 4): its own page counts, window release and prefix keys; a hit takes
    its pages of the window before the hit's last token, cached once the block holding their last token is full."""
    groups = GROUPS[:2] + (CacheGroup("csa_state", (1,), 16, 1, 8, page_rows=2),) + GROUPS[3:]
    kv = HybridKVCacheManager(CachePools(groups, (0, 1, 2, 3), (40, 10, 80, 10), PS))
    assert kv.hit_granularity == 32
    a = req("a", 70)
    assert kv.allocate_slots(a, 15)
    assert [len(b) for b in ids(kv, "a")] == [4, 1, 8, 1]  # 15 rows of csa_state: 8 pages of 2
    a.num_computed_tokens = 15
    before = free_counts(kv)
    assert kv.allocate_slots(a, 1)  # token 15 reads 8..15: state pages 0..3 go back (its rows 0..7)
    assert ids(kv, "a")[2][:4] == [N] * 4 and N not in ids(kv, "a")[2][4:]
    assert free_counts(kv)[2] == before[2] + 4
    a.num_computed_tokens = 16
    assert kv.allocate_slots(a, 54)
    a.num_computed_tokens = 69  # the last block (tokens 68..69) is not full: its state page is not cached yet
    kv.cache_blocks(a)
    assert kv._num_cached["a"][2] == 34
    a.num_computed_tokens = 70
    a_tables = ids(kv, "a")
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    b = Request("b", a.prompt_token_ids[:67] + [5, 5], SamplingParams())
    hit, n = kv.get_computed_blocks(b)
    assert n == 64 and list(hit.blocks[2]) == [N] * 28 + a_tables[2][28:32]  # token 64 reads 57..64: rows 56..63
    assert kv.allocate_slots(b, 5, hit)
    assert len(ids(kv, "b")[2]) == 35


def test_one_pool_when_page_bytes_match():
    g = (CacheGroup("sliding", (0, 1), 8, 1, 8), CacheGroup("hca", (0, 1), 8, 8))
    cfg = V4Config.from_hf_dict(dict(model_type="deepseek_v4", num_hidden_layers=2, head_dim=8, index_head_dim=8,
                                     partial_rotary_factor=0.25, num_attention_heads=2, o_groups=2,
                                     layer_types=["sliding_attention", "heavily_compressed_attention"]))
    assert len(v4_cache_pools(cfg, PS, 30, 2, 8, 64).pool_pages) == 3  # sliding, hca, hca_state differ in bytes
    kv = HybridKVCacheManager(CachePools(g, (0, 0), (12,), PS))
    r = req("r", 16)
    assert kv.allocate_slots(r, 16)
    assert sorted(sum(ids(kv, "r"), [])) == list(range(1, 6))  # 4 token pages + 1 hca page, from one pool


def make_scheduler(csa_pages=4, max_len=40, budget=7):
    pools_ = CachePools(GROUPS, (0, 1, 2, 3), (30, csa_pages, 30, 8), PS)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=max_len)
    return Scheduler(cfg, CacheConfig(page_size=PS, num_pages=None), cache_pools=pools_)


def test_scheduler_refuses_pools_below_one_sequence():
    with pytest.raises(ValueError, match=r"cache groups \['csa'\] has 2 usable pages, fewer than the 3"):
        make_scheduler(csa_pages=3, max_len=40)


def test_scheduler_plans_group_tables_and_preemption_frees_every_group():
    s = make_scheduler(csa_pages=4, max_len=40, budget=7)  # 3 usable csa pages: one 40-token sequence
    a, b = req("a", 30), req("b", 30, base=2000)
    s.add_request(a)
    s.add_request(b)
    for _ in range(9):  # both prefill in chunks; b is preempted once the csa pool runs out
        plan = s.schedule()
        for seq in plan.seqs:
            assert seq.page_ids == seq.group_page_ids[0]
            assert len(seq.group_page_ids[1]) == -(-((seq.start_pos + len(seq.token_ids)) // 4) // PS)
        s.update_from_output(plan, {q.request_id: 7 for q in plan.seqs if q.sample})
    assert s.num_preemptions >= 1
    kv = s.kv_cache_manager
    assert b.status == RequestStatus.PREEMPTED or b.num_preemptions
    s.finish_request("a", "abort")
    s.finish_request("b", "abort")
    assert kv.usage == 0.0


def test_step_metadata_carries_each_groups_table_and_slots():
    """runner/inputs.group_tables: a windowed group's slot for every token, a compressed group's only for the
    token closing its row's window (others and padding: the null page)."""
    from deepinfer_jax.runner.inputs import Shapes, build_metadata

    s = make_scheduler(csa_pages=6, max_len=40, budget=7)
    r = req("r", 30)
    s.add_request(r)
    plan = s.schedule()
    s.update_from_output(plan, {})
    plan = s.schedule()  # positions 7..13: csa rows 1 (closed at 7), 2 (closed at 11); hca row 0 closed at 7
    (seq,) = plan.seqs
    shapes = Shapes(buckets=(8,), max_num_seqs=4, max_pages=10, page_size=PS, max_model_len=40,
                    kv_pools=s.kv_cache_manager.pools_spec)
    meta = build_metadata(plan.seqs, shapes, 8)
    sliding, csa, state, hca = (seq.group_page_ids[i] for i in range(4))
    (t_sl, s_sl), (t_csa, s_csa), (_, s_st), (t_hca, s_hca) = meta.groups
    # compressed tables cover max_model_len (40 tokens: 10 rows of csa); the windowed one is a ring of its window
    # and a step (bucket 8 + 2 rows of drafts): cdiv(7 + 10, 4) + 2 = 7 columns, page i at column i % 7
    assert t_sl.shape == (4, 7) and t_csa.shape == (4, 3) and t_hca.shape == (4, 2)
    assert [t_sl[0, i % 7] for i, b in enumerate(sliding) if b != N] == [b for b in sliding if b != N]
    pos = list(range(7, 14))
    assert s_sl[:7].tolist() == [sliding[p // PS] * PS + p % PS for p in pos] and s_sl[7] == 7 % PS  # padding: null
    assert s_st[:7].tolist() == [state[p // PS] * PS + p % PS for p in pos]
    assert s_csa[:7].tolist() == [csa[0] * PS + 1, 0, 0, 0, csa[0] * PS + 2, 0, 0]
    assert s_hca[:7].tolist() == [hca[0] * PS + 0] + [0] * 6
