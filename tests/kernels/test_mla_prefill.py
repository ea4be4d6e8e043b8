"""The block-query prefill MLA kernel (interpret mode) equals its pure-JAX reference on ragged steps that
mix prefill chunks over cached prefixes, fresh prompts, decode tokens and tail padding."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels.mla_prefill import (effective_block_q, num_query_blocks_bound, paged_mla_prefill_attention,
                                               query_blocks)
from deepinfer_jax.kernels.mla_reference import paged_mla_attention_reference

H, R, DR, PS, L = 4, 64, 16, 8, 2


def _step(seed, chunks, T, *, max_pages=8, S=None, dtype=jnp.float32):
    """chunks: per sequence row (start, n): n new tokens at positions start..start+n-1 (start > 0: the
    row already holds cached pages, a prefix hit or earlier chunks; n == 1: a decode token). Tokens are
    laid out row after row and padded to T with row 0 / position 0, as runner/inputs.py does."""
    rng = np.random.default_rng(seed)
    S = S or len(chunks)
    P = 1 + S * max_pages
    pages = 1 + rng.permutation(P - 1)  # shuffled; page 0 stays the null page
    pt = np.zeros((S, max_pages), np.int32)
    sid, pos = [], []
    for row, (start, n) in enumerate(chunks):
        used = (start + n - 1) // PS + 1
        assert used <= max_pages
        pt[row, :used] = pages[row * max_pages : row * max_pages + used]
        sid += [row] * n
        pos += list(range(start, start + n))
    assert len(sid) <= T
    sid += [0] * (T - len(sid))
    pos += [0] * (T - len(pos))
    ql = jnp.asarray(rng.standard_normal((T, H, R)), dtype)
    qp = jnp.asarray(rng.standard_normal((T, H, DR)), dtype)
    kv = jnp.asarray(rng.standard_normal((L, P, PS, R + DR)), dtype)
    return ql, qp, kv, jnp.asarray(sid, jnp.int32), jnp.asarray(pos, jnp.int32), jnp.asarray(pt)


# Prefix hit spanning pages (24 cached + 13 new), a decode token, a fresh prompt not a multiple of any
# block_q, a second chunk (16 cached + 6 new), a first decode token at position 0; then tail padding.
MIXED = [(24, 13), (40, 1), (0, 9), (16, 6), (0, 1)]


def _check(ql, qp, kv, sid, pos, pt, layer, atol, **kw):
    ref = paged_mla_attention_reference(ql, qp, kv, layer, sid, pos, pt, 0.17).astype(jnp.float32)
    out = paged_mla_prefill_attention(ql, qp, kv, layer, sid, pos, pt, 0.17, interpret=True, **kw)
    assert out.shape == ql.shape and out.dtype == ql.dtype
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), np.asarray(ref), atol=atol, rtol=atol)


@pytest.mark.parametrize("block_q,block_h,splits", [(4, 2, 1), (2, 4, 1), (8, 4, 1), (1, 4, 1), (4, 4, 3)])
def test_mixed_step_matches_reference_fp32(block_q, block_h, splits):
    args = _step(0, MIXED, 64)
    for layer in (0, 1):
        _check(*args, layer, 2e-6, block_q=block_q, block_h=block_h, num_splits=splits)


def test_mixed_step_matches_reference_bf16():
    args = _step(1, MIXED, 64, dtype=jnp.bfloat16)
    _check(*args, 1, 3e-2, block_q=4, block_h=4)


def test_bucket_of_128_with_long_chunks_and_spare_rows():
    """T = 128 with two long prefill chunks, decodes, and sequence rows beyond the real ones."""
    args = _step(2, [(8, 40), (33, 1), (0, 31), (50, 1), (17, 23)], 128, S=8)
    _check(*args, 1, 2e-6, block_q=4, block_h=4)


def test_row_zero_next_to_padding_and_no_padding():
    """Padding (row 0, position 0) after a real row-0 chunk starts its own run; a row-0 prompt of one
    token at position 0 merges with the padding run (same keys, still exact); a full step has none."""
    _check(*_step(3, [(5, 6), (0, 3)], 16), 0, 2e-6, block_q=4, block_h=4)
    args = _step(4, [(0, 1), (9, 2)], 16)
    _check(*args, 0, 2e-6, block_q=4, block_h=4)
    args = _step(5, [(3, 7), (0, 9)], 16)  # no padding at all
    _check(*args, 1, 2e-6, block_q=4, block_h=4)


def test_tiny_step_smaller_than_block_q():
    args = _step(6, [(6, 2), (0, 1)], 3)
    _check(*args, 0, 2e-6, block_q=4, block_h=4)


@pytest.mark.parametrize("seed", [10, 11, 12])
def test_random_ragged_steps(seed):
    rng = np.random.default_rng(seed)
    chunks, total = [], 0
    for _ in range(int(rng.integers(2, 6))):
        n = int(rng.choice([1, 1, int(rng.integers(2, 20))]))
        start = int(rng.integers(0, 8 * PS - n))
        chunks.append((start, n))
        total += n
    T = 1 << max(4, (total - 1).bit_length())
    args = _step(seed, chunks, T)
    _check(*args, int(rng.integers(0, L)), 2e-6, block_q=int(rng.choice([2, 4])), block_h=int(rng.choice([2, 4])),
           num_splits=int(rng.choice([1, 2])))


@pytest.mark.parametrize("order", ["reversed", "shuffled"])
def test_blocks_write_only_their_own_rows(order):
    """Interpret mode runs the programs one after another: with the block table reversed or shuffled, a
    program storing rows outside its block would overwrite rows another block already wrote."""
    ql, qp, kv, sid, pos, pt = _step(9, MIXED, 64)
    bq = effective_block_q(64, 4)
    first, count = query_blocks(sid, pos, bq, num_query_blocks_bound(64, pt.shape[0], bq))
    perm = np.arange(first.shape[0])[::-1] if order == "reversed" else np.random.default_rng(0).permutation(
        first.shape[0])
    ref = paged_mla_attention_reference(ql, qp, kv, 1, sid, pos, pt, 0.17)
    for splits in (1, 2):
        out = paged_mla_prefill_attention(ql, qp, kv, 1, sid, pos, pt, 0.17, block_q=4, block_h=2, num_splits=splits,
                                          interpret=True, blocks=(first[perm], count[perm]))
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=2e-6)


def test_keys_beyond_position_are_invisible():
    """Overwriting every cache slot past each token's own position leaves every output unchanged."""
    ql, qp, kv, sid, pos, pt = _step(7, MIXED, 32)
    out = paged_mla_prefill_attention(ql, qp, kv, 0, sid, pos, pt, 0.2, block_q=4, block_h=4, interpret=True)
    # Row 2 (a fresh prompt of 9 tokens) sees keys 0..8 at most: clobber positions 9..15 of its 2nd page.
    kv2 = np.array(kv)
    p1 = int(pt[2, 1])
    kv2[0, p1, 1:] = 100.0
    out2 = paged_mla_prefill_attention(ql, qp, jnp.asarray(kv2), 0, sid, pos, pt, 0.2, block_q=4, block_h=4,
                                       interpret=True)
    rows = np.asarray(sid) == 2
    np.testing.assert_array_equal(np.asarray(out)[rows], np.asarray(out2)[rows])
    kv3 = np.array(kv)
    kv3[0, p1, 0] = 3.0  # position 8: the last key of the chunk's last token matters
    out3 = paged_mla_prefill_attention(ql, qp, jnp.asarray(kv3), 0, sid, pos, pt, 0.2, block_q=4, block_h=4,
                                       interpret=True)
    last = np.nonzero(rows)[0][-1]
    assert not np.allclose(np.asarray(out)[last], np.asarray(out3)[last])
    np.testing.assert_array_equal(np.asarray(out)[last - 1], np.asarray(out3)[last - 1])


def test_query_blocks_table():
    sid = jnp.asarray([0] * 6 + [1] + [2] * 3 + [0] * 6, jnp.int32)
    pos = jnp.asarray(list(range(10, 16)) + [7] + [0, 1, 2] + [0] * 6, jnp.int32)
    nb = num_query_blocks_bound(16, 3, 4)
    first, count = query_blocks(sid, pos, 4, nb)
    assert first.shape == (nb,) == count.shape
    real = int((np.asarray(count) > 0).sum())
    np.testing.assert_array_equal(np.asarray(first)[:real], [0, 4, 6, 7, 10, 14])
    np.testing.assert_array_equal(np.asarray(count)[:real], [4, 2, 1, 3, 4, 2])
    assert (np.asarray(first)[real:] == 16).all() and (np.asarray(count)[real:] == 0).all()


@pytest.mark.parametrize("block_q", [1, 2, 4, 8])
def test_block_bound_holds_for_runner_layouts(block_q):
    """Any layout of <= S contiguous rows plus tail padding fits in T // block_q + S + 1 blocks, and the
    blocks tile the tokens exactly."""
    rng = np.random.default_rng(block_q)
    for _ in range(50):
        T, S = int(rng.choice([16, 32, 64])), int(rng.integers(1, 9))
        lens = rng.multinomial(int(rng.integers(1, T + 1)), np.ones(S) / S)
        sid = np.zeros(T, np.int32)
        pos = np.zeros(T, np.int32)
        t = 0
        for row, n in enumerate(lens):
            start = int(rng.integers(0, 50))
            sid[t : t + n], pos[t : t + n] = row, np.arange(start, start + n)
            t += n
        first, count = query_blocks(jnp.asarray(sid), jnp.asarray(pos), block_q, num_query_blocks_bound(T, S, block_q))
        first, count = np.asarray(first), np.asarray(count)
        assert count.sum() == T and (count <= block_q).all()
        real = count > 0
        tiles = np.concatenate([np.arange(f, f + c) for f, c in zip(first[real], count[real])])
        np.testing.assert_array_equal(tiles, np.arange(T))
        for f, c in zip(first[real], count[real]):
            assert len(set(sid[f : f + c])) == 1 and (np.diff(pos[f : f + c]) >= 0).all()


def test_paged_attention_dispatch(monkeypatch):
    """deepseek.paged_attention: the prefill kernel when the step has more token slots than sequence rows,
    the decode kernel otherwise; both equal the reference."""
    from deepinfer_jax.kernels import mla_decode, mla_prefill
    from deepinfer_jax.models.cache import StepMetadata
    from deepinfer_jax.models.deepseek import paged_attention

    calls = []
    real_d, real_p = mla_decode.paged_mla_attention, mla_prefill.paged_mla_prefill_attention
    monkeypatch.setattr(mla_decode, "paged_mla_attention", lambda *a, **k: calls.append("decode") or real_d(*a, **k))
    monkeypatch.setattr(mla_prefill, "paged_mla_prefill_attention",
                        lambda *a, **k: calls.append("prefill") or real_p(*a, **k))
    for chunks, T, S, expect in [(MIXED, 32, None, "prefill"), ([(5, 1), (9, 1), (0, 1)], 4, 4, "decode")]:
        ql, qp, kv, sid, pos, pt = _step(8, chunks, T, S=S)
        meta = StepMetadata(token_ids=sid, positions=pos, seq_ids=sid, slot_mapping=sid, page_table=pt,
                            logits_indices=jnp.zeros(pt.shape[0], jnp.int32))
        out = paged_attention(ql, qp, kv, 1, meta, 0.17, "pallas_interpret")
        ref = paged_mla_attention_reference(ql, qp, kv, 1, sid, pos, pt, 0.17)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=2e-6)
        assert calls[-1] == expect


def test_fp8_cache_matches_reference():
    """An e4m3 cache: pages widened to the query's dtype after the load (mla_decode.page_scores), as the
    reference widens its gather."""
    ql, qp, kv, *rest = _step(5, MIXED, 64)
    _check(ql, qp, kv.astype(jnp.float8_e4m3fn), *rest, 1, 2e-6, block_q=4, block_h=4)
