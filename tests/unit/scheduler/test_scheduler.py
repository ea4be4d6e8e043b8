"""Scheduler: budgets, chunked prefill, decode priority, prefix hits, preemption, abort, stops."""

import pytest

from deepinfer_jax.config import CacheConfig, SchedulerConfig
from deepinfer_jax.scheduler.scheduler import Scheduler
from deepinfer_jax.types import Request, RequestStatus, SamplingParams

PS = 4
EOS = 2


def make(num_pages=64, budget=16, max_seqs=8, max_len=64, caching=True, threshold=0):
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_len,
            long_prefill_token_threshold=threshold,
        ),
        CacheConfig(page_size=PS, enable_prefix_caching=caching),
        num_pages,
    )


def req(rid, n, base=100, **sp):
    sp.setdefault("max_tokens", 4)
    return Request(rid, list(range(base, base + n)), SamplingParams(**sp), eos_token_ids=(EOS,))


def step(s, token=7, tokens=None):
    """One engine step: schedule, then sample `token` (or tokens[rid]) for every sampling seq."""
    plan = s.schedule()
    sampled = {q.request_id: (tokens or {}).get(q.request_id, token) for q in plan.seqs if q.sample}
    return plan, s.update_from_output(plan, sampled)


def shape(plan):
    return [(q.request_id, q.start_pos, len(q.token_ids), q.sample) for q in plan.seqs]


def test_budget_and_fcfs():
    s = make(budget=8)
    for i, rid in enumerate("abc"):
        s.add_request(req(rid, 5, base=100 * (i + 1)))
    plan, out = step(s)
    assert shape(plan) == [("a", 0, 5, True), ("b", 0, 3, False)]
    assert plan.num_scheduled_tokens == 8 and s.num_running == 2 and s.num_waiting == 1
    assert [(r.request_id, t, f) for r, t, f in out] == [("a", [7], False)]
    plan, _ = step(s)
    # decode of a first, then b's remaining 2 prompt tokens, then c takes the rest (5)
    assert shape(plan) == [("a", 5, 1, True), ("b", 3, 2, True), ("c", 0, 5, True)]
    assert plan.seqs[1].token_ids == [203, 204]


def test_max_num_seqs():
    s = make(budget=64, max_seqs=2)
    for rid in "abc":
        s.add_request(req(rid, 3, base=ord(rid) * 100))
    plan, _ = step(s)
    assert [q.request_id for q in plan.seqs] == ["a", "b"] and s.num_waiting == 1


def test_chunked_prefill_exact_chunks_and_pages():
    s = make(budget=8)
    r = req("long", 20)
    s.add_request(r)
    starts = []
    for _ in range(3):
        plan, _ = step(s)
        (q,) = plan.seqs
        starts.append((q.start_pos, len(q.token_ids), q.sample, q.page_ids))
        assert q.token_ids == list(range(100 + q.start_pos, 100 + q.start_pos + len(q.token_ids)))
    assert starts == [
        (0, 8, False, [1, 2]),
        (8, 8, False, [1, 2, 3, 4]),
        (16, 4, True, [1, 2, 3, 4, 5]),
    ]
    assert r.num_computed_tokens == 20 and r.output_token_ids == [7]


def test_long_prefill_threshold():
    s = make(budget=16, threshold=6)
    s.add_request(req("a", 20))
    s.add_request(req("b", 4, base=300))
    plan, _ = step(s)
    assert shape(plan) == [("a", 0, 6, False), ("b", 0, 4, True)]


def test_decodes_never_starved_by_long_prefill():
    s = make(budget=16, num_pages=128, max_len=256)
    s.add_request(req("d1", 3, max_tokens=30))
    s.add_request(req("d2", 3, base=200, max_tokens=30))
    step(s)  # both prompts done, one token each
    s.add_request(req("long", 200, base=1000, max_tokens=2))
    seen = 0
    while s.requests["long"].num_output_tokens == 0:
        plan, _ = step(s)
        assert [q.request_id for q in plan.seqs[:2]] == ["d1", "d2"]
        assert all(q.is_decode for q in plan.seqs[:2])
        if len(plan.seqs) == 3:
            assert plan.seqs[2].request_id == "long" and len(plan.seqs[2].token_ids) <= 14
        seen += 1
    assert seen == 15  # 200 prompt tokens at 14 per step


def test_threshold_prefill_does_not_block_later_decodes():
    # a mid-prefill request ahead of a decoding one in the running list still yields to it
    s = make(budget=8, threshold=4)
    s.add_request(req("p", 40))
    s.add_request(req("d", 2, base=500, max_tokens=10))
    plan, _ = step(s)
    assert shape(plan) == [("p", 0, 4, False), ("d", 0, 2, True)]
    plan, _ = step(s)
    assert shape(plan) == [("d", 2, 1, True), ("p", 4, 4, False)]


def test_prefix_hit_skips_blocks_but_computes_last_token():
    s = make(budget=64)
    s.add_request(req("a", 8, max_tokens=1))
    step(s)
    assert not s.has_unfinished_requests()
    b = req("b", 8, max_tokens=1)
    s.add_request(b)
    plan, _ = step(s)
    # full blocks [0,4) and [4,8) are cached, but the last token must be computed: hit 4 tokens
    assert shape(plan) == [("b", 4, 4, True)] and b.num_cached_tokens == 4
    c = req("c", 9, max_tokens=1)
    s.add_request(c)
    plan, _ = step(s)
    assert shape(plan) == [("c", 8, 1, True)] and c.num_cached_tokens == 8
    st = s.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (8 + 8 + 9, 0 + 4 + 8)


def test_preemption_and_recovery():
    # 4 usable pages of 4 tokens; two requests of 6 prompt tokens hold 2 pages each
    s = make(num_pages=5, budget=32, max_len=16, caching=False)
    a, b = req("a", 6, max_tokens=6), req("b", 6, base=200, max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    step(s)
    step(s)  # positions 6 computed: both at 8 tokens, still 2 pages each
    plan, _ = step(s)  # position 7 is the last slot of page 2
    assert plan.preempted_ids == []
    plan, _ = step(s)  # a needs a 3rd page for position 8: b (newest) is preempted
    assert plan.preempted_ids == ["b"] and shape(plan) == [("a", 8, 1, True)]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.waiting[0] is b and b.num_preemptions == 1
    assert b.output_token_ids == [7, 7, 7]  # kept; recomputed later
    while not a.is_finished:
        plan, _ = step(s)
        assert [q.request_id for q in plan.seqs] == ["a"]
    assert a.output_token_ids == [7] * 6 and a.finish_reason == "length"
    plan, _ = step(s)  # b recomputes prompt + its 3 outputs as one prefill and samples
    assert shape(plan) == [("b", 0, 9, True)]
    assert plan.seqs[0].token_ids == list(range(200, 206)) + [7, 7, 7]
    assert plan.finished_ids == ["a"]
    while s.has_unfinished_requests():
        step(s)
    assert b.output_token_ids == [7] * 6
    assert s.kv_cache_manager.usage == 0.0 and s.stats().num_preemptions == 1


def test_self_preemption_when_newest():
    s = make(num_pages=5, budget=32, max_len=16, caching=False)
    s.add_request(req("a", 7, max_tokens=8))
    b = req("b", 8, base=200, max_tokens=8)
    s.add_request(b)
    step(s)  # a: 2 pages, b: 2 pages, all 4 used
    plan, _ = step(s)  # a's position 7 fits; b's position 8 needs a page and b is the newest
    assert plan.preempted_ids == ["b"] and shape(plan) == [("a", 7, 1, True)]
    assert b.status is RequestStatus.PREEMPTED and s.kv_cache_manager.get_block_ids("b") == []
    assert list(s.waiting) == [b]
    plan, _ = step(s)  # a takes a 3rd page; b (9 tokens = 3 pages) does not fit in the last one
    assert shape(plan) == [("a", 8, 1, True)] and plan.preempted_ids == [] and s.num_waiting == 1


def test_abort_frees_blocks_running_waiting_and_inflight():
    s = make(budget=8)
    s.add_request(req("a", 6))
    s.add_request(req("b", 6, base=200))
    s.add_request(req("c", 6, base=300))
    step(s)
    assert s.kv_cache_manager.usage > 0
    assert s.abort_request("c")  # still waiting
    assert s.abort_request("a")
    assert not s.abort_request("a") and not s.abort_request("zzz")
    plan = s.schedule()
    assert plan.finished_ids == ["c", "a"]
    assert s.abort_request("b")  # aborted while its step is in flight
    assert s.update_from_output(plan, {"b": 5}) == []
    assert s.kv_cache_manager.usage == 0.0 and not s.has_unfinished_requests()
    assert s.schedule().finished_ids == ["b"]


def test_finish_request_with_stop_string():
    s = make()
    r = req("a", 3)
    s.add_request(r)
    step(s)
    assert s.finish_request("a", "stop", stop_reason="###")
    assert r.finish_reason == "stop" and r.stop_reason == "###"
    assert s.kv_cache_manager.usage == 0.0
    with pytest.raises(ValueError):
        s.finish_request("a", "bogus")


def run_one(r, tokens, max_len=64):
    s = make(max_len=max_len)
    s.add_request(r)
    outs = []
    for t in tokens:
        _, out = step(s, token=t)
        outs.extend(out)
        if r.is_finished:
            break
    assert s.kv_cache_manager.usage == 0.0 or not r.is_finished
    return outs


def test_eos_stops():
    r = req("a", 3, max_tokens=10)
    outs = run_one(r, [5, 6, EOS, 8])
    assert r.output_token_ids == [5, 6, EOS] and r.finish_reason == "stop" and r.stop_reason is None
    assert outs[-1][2] is True and outs[-1][1] == [EOS]


def test_ignore_eos_runs_to_max_tokens():
    r = req("a", 3, max_tokens=4, ignore_eos=True)
    run_one(r, [EOS] * 10)
    assert r.output_token_ids == [EOS] * 4 and r.finish_reason == "length"


def test_min_tokens_holds_eos_and_stop_ids():
    r = req("a", 3, max_tokens=10, min_tokens=3, stop_token_ids=[9])
    run_one(r, [EOS, 9, EOS, 5])
    assert r.output_token_ids == [EOS, 9, EOS] and r.finish_reason == "stop"
    r = req("b", 3, max_tokens=10, min_tokens=2, stop_token_ids=[9])
    run_one(r, [9, 9, 9])
    assert r.output_token_ids == [9, 9] and r.stop_reason == 9


def test_length_beats_stop_on_last_token():
    r = req("a", 3, max_tokens=2)
    run_one(r, [5, EOS])
    assert r.finish_reason == "length"


def test_max_model_len_caps():
    r = req("a", 5, max_tokens=None)
    run_one(r, [5] * 100, max_len=12)
    assert r.num_tokens == 12 and r.finish_reason == "length"
    r = req("b", 12, max_tokens=None)
    run_one(r, [5] * 100, max_len=12)
    assert r.output_token_ids == [5] and r.finish_reason == "length"


def test_validation_and_protocol():
    with pytest.raises(ValueError, match="num_pages"):
        make(num_pages=16, max_len=64)  # needs 16 pages + the null page
    s = make(max_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(req("x", 17))
    with pytest.raises(ValueError, match="empty"):
        s.add_request(req("x", 0))
    s.add_request(req("x", 3))
    with pytest.raises(ValueError, match="already"):
        s.add_request(req("x", 3))
    plan = s.schedule()
    with pytest.raises(RuntimeError):
        s.schedule()
    with pytest.raises(KeyError):
        s.update_from_output(plan, {})
    s.update_from_output(plan, {"x": 1})
    assert s.requests["x"].output_token_ids == [1]


def test_empty_plan_needs_no_update():
    s = make()
    plan = s.schedule()
    assert plan.is_empty and plan.num_scheduled_tokens == 0
    assert s.update_from_output(plan, {}) == []
    assert s.schedule().is_empty


def test_rooms_import_no_jax():
    """ARCHITECTURE rule 2: types.py and scheduler/ are plain Python (checked on the source)."""
    import ast
    import pathlib

    import deepinfer_jax.scheduler as pkg
    import deepinfer_jax.types as types_mod

    files = [pathlib.Path(types_mod.__file__), *pathlib.Path(pkg.__file__).parent.glob("*.py")]
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in ("jax", "jaxlib", "numpy", "flax"), (f.name, name)
