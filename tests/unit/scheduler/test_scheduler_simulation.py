"""Simulated engine loop over a fake paged KV store.

Sampled tokens are a deterministic function of (request, position) and a cache entry is a hash of
the whole prefix up to its position, so a recompute after preemption and a prefix hit must find
exactly what a full computation would have written. Every step checks:
the plan respects the budgets and orders decodes first; each sequence's pages already hold the
right entries for every position before start_pos (prefix hits and page tables are correct, no
request wrote into another's pages); pages written this step are private; ref counts equal the
number of page tables holding each page; decodes are never skipped. At the end every request has
exactly max_tokens outputs, and all pages are free (no leaks).
"""

import random
import zlib

import pytest

from deepinfer_jax.config import CacheConfig, SchedulerConfig
from deepinfer_jax.scheduler.kv_cache_manager import cdiv
from deepinfer_jax.scheduler.scheduler import Scheduler
from deepinfer_jax.types import Request, SamplingParams

EOS = 2


def fake_token(rid, pos):
    return zlib.crc32(f"{rid}:{pos}".encode()) % 490 + 10  # never EOS


def fake_kv(toks, pos):
    """A cache entry depends on the whole prefix, as real KV does (attention mixed it in)."""
    return zlib.crc32(repr(toks[: pos + 1]).encode())


def check_refcounts(s):
    kv = s.kv_cache_manager
    pool = kv.block_pool
    holders = [0] * pool.num_pages
    for rid in s.requests:
        for b in kv.get_block_ids(rid):
            holders[b] += 1
    for b in range(1, pool.num_pages):
        assert pool.ref_count(b) == holders[b], f"block {b}"
    assert set(pool.free_block_ids()) == {b for b in range(1, pool.num_pages) if holders[b] == 0}


def simulate(seed, ps, num_pages, budget, max_seqs, max_len, threshold, caching, n_req, aborts):
    rng = random.Random(seed)
    s = Scheduler(
        SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_len,
            long_prefill_token_threshold=threshold,
        ),
        CacheConfig(page_size=ps, enable_prefix_caching=caching),
        num_pages,
    )
    # Prompts are built from a few shared blocks, so equal blocks follow different prefixes, and
    # some prompts repeat exactly (hits up to the last-token rule).
    library = [[rng.randrange(10, 500) for _ in range(ps)] for _ in range(3)]
    arrivals, prompts = [], []
    for i in range(n_req):
        max_tokens = rng.randrange(1, max_len // 3)
        room = max_len - max_tokens
        if prompts and rng.random() < 0.25 and len(prompts[-1]) <= room:
            prompt = list(rng.choice([p for p in prompts if len(p) <= room]))
        else:
            prompt = []
            for _ in range(rng.randrange(0, 4)):
                prompt += rng.choice(library)
            prompt += [rng.randrange(10, 500) for _ in range(rng.randrange(0, ps + 1))]
            prompt = prompt[:room] or [11]
        prompts.append(prompt)
        assert len(prompt) + max_tokens <= max_len
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), eos_token_ids=(EOS,))
        arrivals.append((rng.randrange(0, 3 * n_req), r))
    arrivals.sort(key=lambda x: x[0])
    pages = {}  # page id -> {slot: token}
    done, aborted = [], set()
    stats = {"preempted": 0}
    step = 0
    while arrivals or s.has_unfinished_requests():
        assert step < 20000, "no progress"
        while arrivals and arrivals[0][0] <= step:
            s.add_request(arrivals.pop(0)[1])
        if aborts and s.requests and rng.random() < 0.05:
            rid = rng.choice(sorted(s.requests))
            assert s.abort_request(rid)
            aborted.add(rid)
        decoding = {r.request_id for r in s.running if r.num_tokens - r.num_computed_tokens == 1}
        plan = s.schedule()
        stats["preempted"] += len(plan.preempted_ids)
        assert plan.num_scheduled_tokens == sum(len(q.token_ids) for q in plan.seqs) <= budget
        assert len(plan.seqs) <= max_seqs
        kinds = [q.is_decode for q in plan.seqs]
        assert kinds == sorted(kinds, reverse=True), "decodes first"
        if budget >= max_seqs:
            assert decoding <= {q.request_id for q in plan.seqs} | set(plan.preempted_ids)
        check_refcounts(s)
        for q in plan.seqs:
            r = s.requests[q.request_id]
            toks = r.all_token_ids
            n = len(q.token_ids)
            assert q.start_pos == r.num_computed_tokens and q.token_ids == toks[q.start_pos : q.start_pos + n]
            assert len(q.page_ids) == cdiv(q.start_pos + n, ps) and 0 not in q.page_ids
            assert q.sample == (q.start_pos + n == r.num_tokens)
            for pos in range(q.start_pos):
                assert pages[q.page_ids[pos // ps]][pos % ps] == fake_kv(toks, pos), (q.request_id, pos)
        for q in plan.seqs:
            toks = s.requests[q.request_id].all_token_ids
            for pos in range(q.start_pos, q.start_pos + len(q.token_ids)):
                page = q.page_ids[pos // ps]
                assert s.kv_cache_manager.block_pool.ref_count(page) == 1, "write into a shared page"
                pages.setdefault(page, {})[pos % ps] = fake_kv(toks, pos)
        sampled = {q.request_id: fake_token(q.request_id, s.requests[q.request_id].num_tokens)
                   for q in plan.seqs if q.sample}
        for r, new, finished in s.update_from_output(plan, sampled):
            assert new == [sampled[r.request_id]]
            if finished:
                done.append(r)
        step += 1
    for r in done:
        assert r.finish_reason == "length" and r.num_output_tokens == r.sampling_params.max_tokens
        p = r.num_prompt_tokens
        assert r.output_token_ids == [fake_token(r.request_id, p + k) for k in range(r.num_output_tokens)]
    assert len(done) + len(aborted) == n_req
    assert {r.request_id for r in done}.isdisjoint(aborted)
    pool = s.kv_cache_manager.block_pool
    assert s.kv_cache_manager.usage == 0.0 and pool.num_free_blocks == pool.num_usable_blocks
    assert all(pool.ref_count(b) == 0 for b in range(1, pool.num_pages))
    assert not s.requests and not s.running and not s.waiting
    st = s.stats()
    return stats["preempted"], st.prefix_cache_hits


CONFIGS = {
    # name: (ps, num_pages, budget, max_seqs, max_len, threshold, caching)
    "tight": (4, 10, 16, 8, 32, 0, True),
    "tight_no_cache": (4, 10, 16, 8, 32, 0, False),
    "threshold": (4, 14, 24, 6, 48, 5, True),
    "small_budget": (2, 20, 3, 8, 24, 0, True),
    "roomy": (8, 64, 64, 16, 64, 0, True),
}


@pytest.mark.parametrize("aborts", [False, True])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_simulated_loop_completes_without_leaks(name, aborts):
    preempted = hits = 0
    for seed in range(8):
        p, h = simulate(seed, *CONFIGS[name], n_req=24, aborts=aborts)
        preempted += p
        hits += h
    if name.startswith("tight"):
        assert preempted > 0  # the configuration really exercises preemption
    if CONFIGS[name][-1]:
        assert hits > 0
