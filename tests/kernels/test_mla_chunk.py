"""The expanded-form chunk attention (interpret mode) equals its pure-JAX reference, and the split
prefill attention (chunk expanded + cached context absorbed, merged) equals full absorbed attention."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels.mla_chunk import chunk_attention, chunk_attention_reference, merge_with_context, normalise
from deepinfer_jax.kernels.mla_prefill import (effective_block_q, num_query_blocks_bound,
                                               paged_mla_prefill_attention, query_blocks, run_starts)
from deepinfer_jax.kernels.mla_reference import paged_mla_attention_reference

H, DN, DR, DV, R, PS = 4, 32, 16, 32, 64, 8


def _runs(chunks, T):
    """chunks: per sequence row (start, n) as in test_mla_prefill; padded with row 0 / position 0."""
    sid, pos = [], []
    for row, (start, n) in enumerate(chunks):
        sid += [row] * n
        pos += list(range(start, start + n))
    sid += [0] * (T - len(sid))
    pos += [0] * (T - len(pos))
    return jnp.asarray(sid, jnp.int32), jnp.asarray(pos, jnp.int32)


MIXED = [(24, 13), (40, 1), (0, 9), (16, 6), (0, 1)]


@pytest.mark.parametrize("block_q,block_k", [(8, 16), (4, 8), (16, 16)])
def test_chunk_kernel_matches_reference(block_q, block_k):
    T = 64
    rng = np.random.default_rng(block_q)
    qn = jnp.asarray(rng.standard_normal((T, H, DN)), jnp.float32)
    qp = jnp.asarray(rng.standard_normal((T, H, DR)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((T, H, DN + DV)), jnp.float32)
    kp = jnp.asarray(rng.standard_normal((T, DR)), jnp.float32)
    sid, pos = _runs(MIXED, T)
    rs = run_starts(sid, pos)
    bq = effective_block_q(T, block_q)
    blocks = query_blocks(sid, pos, bq, num_query_blocks_bound(T, len(MIXED), bq))
    got = chunk_attention(qn, qp, kv, kp, rs, blocks, 0.2, block_q=bq, block_k=block_k, interpret=True)
    want = chunk_attention_reference(qn, qp, kv, kp, rs, 0.2)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=2e-6)
    acc, _, l = got
    assert (np.asarray(l) >= 1.0 - 1e-6).all()  # every row sees at least its own key


def _mixed_cache(seed, chunks, T, max_pages=8, dtype=jnp.float32):
    """Absorbed inputs over a cache that holds every sequence's context and this step's latents, plus
    the per-head W_UK / W_UV that tie the expanded form to it."""
    rng = np.random.default_rng(seed)
    S = len(chunks)
    P = 1 + S * max_pages
    pages = 1 + rng.permutation(P - 1)
    pt = np.zeros((S, max_pages), np.int32)
    for row, (start, n) in enumerate(chunks):
        used = (start + n - 1) // PS + 1
        pt[row, :used] = pages[row * max_pages: row * max_pages + used]
    sid, pos = _runs(chunks, T)
    kv_cache = jnp.asarray(rng.standard_normal((1, P, PS, R + DR)), dtype)
    # This step's latents are the cache entries at their positions (as if just written).
    pt_j = jnp.asarray(pt)
    latent = kv_cache[0, pt_j[sid, pos // PS], pos % PS]  # [T, R + DR]
    w_uk = jnp.asarray(rng.standard_normal((R, H, DN)) * 0.1, dtype)
    w_uv = jnp.asarray(rng.standard_normal((R, H, DV)) * 0.1, dtype)
    q_nope = jnp.asarray(rng.standard_normal((T, H, DN)), dtype)
    q_pe = jnp.asarray(rng.standard_normal((T, H, DR)), dtype)
    return kv_cache, pt_j, sid, pos, latent, w_uk, w_uv, q_nope, q_pe


def test_split_attention_equals_full_absorbed_attention():
    """Chunk part (expanded, keys rebuilt from this step's latents) merged with the context part
    (absorbed over the cache, keys before each chunk) equals absorbed attention over everything:
    prefix hits, a decode token, fresh prompts, a second chunk, padding."""
    T = 64
    kv_cache, pt, sid, pos, latent, w_uk, w_uv, q_nope, q_pe = _mixed_cache(0, MIXED, T)
    q_lat = jnp.einsum("thd,rhd->thr", q_nope, w_uk, precision="highest")
    full = paged_mla_attention_reference(q_lat, q_pe, kv_cache, 0, sid, pos, pt, 0.15)  # [T, H, R]
    want = jnp.einsum("thr,rhv->thv", full, w_uv, precision="highest")

    rs = run_starts(sid, pos)
    o_ctx, m2, l2 = paged_mla_prefill_attention(q_lat, q_pe, kv_cache, 0, sid, pos, pt, 0.15, block_q=4,
                                                block_h=2, visible_to=pos[rs] - 1, return_lse=True, interpret=True)
    o_ctx = jnp.einsum("thr,rhv->thv", o_ctx, w_uv, precision="highest")
    c_kv, k_pe = latent[:, :R], latent[:, R:]
    kv = jnp.concatenate([jnp.einsum("tr,rhd->thd", c_kv, w_uk, precision="highest"),
                          jnp.einsum("tr,rhv->thv", c_kv, w_uv, precision="highest")], axis=-1)
    bq = effective_block_q(T, 16)
    blocks = query_blocks(sid, pos, bq, num_query_blocks_bound(T, len(MIXED), bq))
    acc, m1, l1 = chunk_attention(q_nope, q_pe, kv, k_pe, rs, blocks, 0.15, block_q=bq, block_k=16, interpret=True)
    got = merge_with_context(acc, m1, l1, o_ctx, m2, l2)
    real = int(sum(n for _, n in MIXED))
    np.testing.assert_allclose(np.asarray(got)[:real], np.asarray(want)[:real], rtol=2e-5, atol=2e-5)
    # Fresh prompts and first tokens have no context: l2 = 0 there, and the merge takes the chunk alone.
    assert (np.asarray(l2)[14:23] == 0).all()  # the fresh 9-token prompt (tokens 14..22)
    assert (np.asarray(l2)[:13] > 0).all()  # the prefix hit (24 cached tokens) sees them


def test_context_only_rows_without_context_return_zero_weight():
    T = 16
    kv_cache, pt, sid, pos, latent, w_uk, w_uv, q_nope, q_pe = _mixed_cache(1, [(0, 7), (5, 4)], T)
    q_lat = jnp.einsum("thd,rhd->thr", q_nope, w_uk, precision="highest")
    rs = run_starts(sid, pos)
    o, m, l = paged_mla_prefill_attention(q_lat, q_pe, kv_cache, 0, sid, pos, pt, 0.15, block_q=4, block_h=4,
                                          visible_to=pos[rs] - 1, return_lse=True, interpret=True)
    l = np.asarray(l)
    assert (l[:7] == 0).all() and (np.asarray(o)[:7] == 0).all()  # a fresh prompt: no context
    assert (l[7:11] > 0).all()  # the second chunk sees its 5 cached tokens
    # ... and exactly those: the context part equals the reference restricted to positions 0..4.
    ref = paged_mla_attention_reference(q_lat[7:11], q_pe[7:11], kv_cache, 0, sid[7:11], jnp.full((4,), 4), pt, 0.15)
    np.testing.assert_allclose(np.asarray(o)[7:11], np.asarray(ref), rtol=2e-6, atol=2e-6)


def test_context_only_pass_with_splits_equals_one_split():
    """return_lse over several context splits (merged in JAX) gives the one-split kernel's o, m and l,
    rows without context included (o = 0, l = 0)."""
    T = 64
    kv_cache, pt, sid, pos, _, w_uk, _, q_nope, q_pe = _mixed_cache(2, MIXED, T)
    q_lat = jnp.einsum("thd,rhd->thr", q_nope, w_uk, precision="highest")
    vis = pos[run_starts(sid, pos)] - 1
    one = paged_mla_prefill_attention(q_lat, q_pe, kv_cache, 0, sid, pos, pt, 0.15, block_q=4, block_h=2,
                                      visible_to=vis, return_lse=True, interpret=True)
    three = paged_mla_prefill_attention(q_lat, q_pe, kv_cache, 0, sid, pos, pt, 0.15, block_q=4, block_h=2,
                                        num_splits=3, visible_to=vis, return_lse=True, interpret=True)
    real = int(sum(n for _, n in MIXED))
    np.testing.assert_allclose(np.asarray(three[0])[:real], np.asarray(one[0])[:real], rtol=2e-6, atol=2e-6)
    has = np.asarray(one[2])[:real] > 0
    np.testing.assert_allclose(np.asarray(three[1])[:real][has], np.asarray(one[1])[:real][has], rtol=1e-6)
    # l is relative to each pass's own max: compare l * exp(m) (the softmax denominator) instead.
    den = lambda r: np.asarray(r[2])[:real][has] * np.exp(np.asarray(r[1])[:real][has])  # noqa: E731
    np.testing.assert_allclose(den(three), den(one), rtol=1e-5)
    assert (np.asarray(one[2])[:real][~has] == 0).all() and (np.asarray(one[0])[:real][~has] == 0).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fresh_prompts_need_no_context_part(dtype):
    """A step of fresh prompts (and padding): no token sees cached context (the predicate of
    models/mla_split.py attend_split's cond), and the chunk part alone, normalised (in JAX, and in the kernel
    with `out_dtype`), equals the merge with the real context kernel's empty output bit for bit."""
    T, chunks = 32, [(0, 9), (0, 13), (0, 1)]
    kv_cache, pt, sid, pos, latent, w_uk, w_uv, q_nope, q_pe = _mixed_cache(3, chunks, T, dtype=dtype)
    rs = run_starts(sid, pos)
    vis = pos[rs] - 1
    assert not bool(jnp.any(vis >= 0))
    q_lat = jnp.einsum("thd,rhd->thr", q_nope, w_uk)
    o_ctx, m2, l2 = paged_mla_prefill_attention(q_lat, q_pe, kv_cache, 0, sid, pos, pt, 0.15, block_q=4, block_h=2,
                                                visible_to=vis, return_lse=True, interpret=True)
    o_ctx = jnp.einsum("thr,rhv->thv", o_ctx.astype(dtype), w_uv)
    c_kv, k_pe = latent[:, :R], latent[:, R:]
    kv = jnp.concatenate([jnp.einsum("tr,rhd->thd", c_kv, w_uk), jnp.einsum("tr,rhv->thv", c_kv, w_uv)], axis=-1)
    bq = effective_block_q(T, 16)
    blocks = query_blocks(sid, pos, bq, num_query_blocks_bound(T, len(chunks), bq))
    acc, m1, l1 = chunk_attention(q_nope, q_pe, kv, k_pe, rs, blocks, 0.15, block_q=bq, block_k=16, interpret=True)
    merged = merge_with_context(acc, m1, l1, o_ctx, m2, l2)
    np.testing.assert_array_equal(np.asarray(normalise(acc, m1, l1)), np.asarray(merged))
    # The kernel's normalised output (what the step without context takes) is the same, rounded once.
    o = chunk_attention(q_nope, q_pe, kv, k_pe, rs, blocks, 0.15, block_q=bq, block_k=16, out_dtype=dtype,
                        interpret=True)
    real = sum(n for _, n in chunks)
    assert o.dtype == dtype
    np.testing.assert_array_equal(np.asarray(o.astype(jnp.float32))[:real],
                                  np.asarray(merged.astype(dtype).astype(jnp.float32))[:real])
    # One token of cached context anywhere in the step makes the predicate true.
    sid2, pos2 = _runs([(0, 9), (1, 13)], T)
    assert bool(jnp.any(pos2[run_starts(sid2, pos2)] - 1 >= 0))


# Long runs over long contexts: a prefix hit of 30 new tokens over 40 cached, a second chunk of 20 over 36,
# a decode token, a fresh prompt, a short run of 3 over 9 cached; padding after.
LONG = [(40, 30), (36, 20), (44, 1), (0, 9), (9, 3)]


def _long_split(seed, window, min_queries, block_q=16, block_k=16, dtype=jnp.float32):
    """The split attention with the expanded context (kernels/mla_context.py) for the runs of at least
    `min_queries` tokens, the absorbed context for the rest, against full absorbed attention."""
    from deepinfer_jax.kernels import mla_context

    T = 128
    kv_cache, pt, sid, pos, latent, w_uk, w_uv, q_nope, q_pe = _mixed_cache(seed, LONG, T, 12, dtype)
    q_lat = jnp.einsum("thd,rhd->thr", q_nope, w_uk, precision="highest")
    full = paged_mla_attention_reference(q_lat, q_pe, kv_cache, 0, sid, pos, pt, 0.15)
    want = jnp.einsum("thr,rhv->thv", full, w_uv, precision="highest")

    def up(c):
        return jnp.concatenate([jnp.einsum("tr,rhd->thd", c, w_uk, precision="highest"),
                                jnp.einsum("tr,rhv->thv", c, w_uv, precision="highest")], axis=-1)

    rs = run_starts(sid, pos)
    bq = effective_block_q(T, block_q)
    blocks = query_blocks(sid, pos, bq, num_query_blocks_bound(T, len(LONG), bq))
    picked, cu = mla_context.plan(sid, pos, rs, len(LONG), min_queries)
    state = chunk_attention(q_nope, q_pe, up(latent[:, :R]), latent[:, R:], rs, blocks, 0.15, block_q=bq,
                            block_k=block_k, interpret=True)
    ref = mla_context.expanded_context_reference(q_nope, q_pe, kv_cache, 0, pt, sid, pos, picked, up, 0.15, state)
    state = mla_context.expanded_context(q_nope, q_pe, kv_cache, 0, pt, sid, picked, cu, blocks, up, 0.15, state,
                                         block_q=bq, window=window, interpret=True)
    vis = jnp.where(picked, -1, pos[rs] - 1)
    o_ctx, m2, l2 = paged_mla_prefill_attention(q_lat, q_pe, kv_cache, 0, sid, pos, pt, 0.15, block_q=4,
                                                block_h=2, visible_to=vis, return_lse=True, interpret=True)
    o_ctx = jnp.einsum("thr,rhv->thv", o_ctx, w_uv, precision="highest")
    got = merge_with_context(*state, o_ctx, m2, l2)
    return got, want, state, ref, picked, cu


@pytest.mark.parametrize("window,min_queries", [(16, 8), (64, 8), (16, 25), (64, 1000)])
def test_expanded_context_equals_full_absorbed_attention(window, min_queries):
    """Runs of min_queries+ tokens take their context window by window in the expanded form (contexts longer
    than a window, a window holding two sequences' contexts), the rest absorbed; merged, the step equals full
    absorbed attention, and the kernel's state equals its pure-JAX reference."""
    got, want, state, ref, picked, cu = _long_split(4, window, min_queries)
    real = sum(n for _, n in LONG)
    np.testing.assert_allclose(np.asarray(got)[:real], np.asarray(want)[:real], rtol=2e-5, atol=2e-5)
    for g, r in zip(state, ref):
        np.testing.assert_allclose(np.asarray(g)[:real], np.asarray(r)[:real], rtol=2e-5, atol=2e-5)
    long_runs = [row for row, (start, n) in enumerate(LONG) if n >= min_queries and start > 0]
    ctx = np.zeros(len(LONG), np.int64)
    ctx[long_runs] = [LONG[row][0] for row in long_runs]
    np.testing.assert_array_equal(np.asarray(cu), np.concatenate([[0], np.cumsum(ctx)]))
    owner = np.repeat(np.arange(len(LONG)), [n for _, n in LONG])
    np.testing.assert_array_equal(np.asarray(picked)[:real], np.isin(owner, long_runs))
    assert not np.asarray(picked)[real:].any()  # padding: row 0 at position 0, no context


def test_expanded_context_in_bfloat16_is_close():
    got, want, *_ = _long_split(5, 32, 8, dtype=jnp.bfloat16)
    real = sum(n for _, n in LONG)
    np.testing.assert_allclose(np.asarray(got, np.float32)[:real], np.asarray(want, np.float32)[:real],
                               rtol=3e-2, atol=3e-2)


def test_context_window_size():
    from deepinfer_jax.kernels.mla_context import window_size

    assert window_size(16, 256, 2) == 8192  # V2-Lite
    assert window_size(128, 256, 2) == 1024  # V3
    assert window_size(128, 256, 4) == 512
