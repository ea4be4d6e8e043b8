"""The paged MLA attention kernel (interpret mode) equals its pure-JAX reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels.mla_decode import paged_mla_attention
from deepinfer_jax.kernels.mla_reference import paged_mla_attention_reference


def _case(seed, T=7, H=8, R=64, dr=16, P=20, ps=8, L=3, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    ql = jnp.asarray(rng.standard_normal((T, H, R)), dtype)
    qp = jnp.asarray(rng.standard_normal((T, H, dr)), dtype)
    kv = jnp.asarray(rng.standard_normal((L, P, ps, R + dr)), dtype)
    # Three sequences with shuffled pages; tokens mix decode rows and a prefill chunk.
    pages = rng.permutation(np.arange(1, P))
    pt = np.zeros((3, 6), np.int32)
    pt[0, :3], pt[1, :1], pt[2, :6] = pages[:3], pages[3:4], pages[4:10]
    sid = np.array([0, 1, 2, 2, 2, 2, 2][:T], np.int32)
    pos = np.array([20, 0, 40, 41, 42, 43, 47][:T], np.int32)
    return ql, qp, kv, jnp.asarray(sid), jnp.asarray(pos), jnp.asarray(pt)


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("block_h", [4, 8])
def test_kernel_matches_reference_fp32(splits, block_h):
    ql, qp, kv, sid, pos, pt = _case(0)
    for layer in (0, 2):
        ref = paged_mla_attention_reference(ql, qp, kv, layer, sid, pos, pt, 0.17)
        out = paged_mla_attention(ql, qp, kv, layer, sid, pos, pt, 0.17, num_splits=splits, block_h=block_h,
                                  interpret=True)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=2e-6)


def test_kernel_matches_reference_bf16():
    ql, qp, kv, sid, pos, pt = _case(1, dtype=jnp.bfloat16)
    ref = paged_mla_attention_reference(ql, qp, kv, 1, sid, pos, pt, 0.17).astype(jnp.float32)
    out = paged_mla_attention(ql, qp, kv, 1, sid, pos, pt, 0.17, num_splits=2, block_h=8, interpret=True)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), np.asarray(ref), atol=3e-2, rtol=3e-2)


def test_keys_beyond_position_are_invisible():
    """Changing the cache after a token's position must not change its output."""
    ql, qp, kv, sid, pos, pt = _case(2)
    out = paged_mla_attention(ql, qp, kv, 0, sid, pos, pt, 0.2, num_splits=2, block_h=8, interpret=True)
    page = int(pt[1, 0])  # sequence 1 only holds position 0 in its first page
    kv2 = kv.at[0, page, 1:].set(100.0)
    out2 = paged_mla_attention(ql, qp, kv2, 0, sid, pos, pt, 0.2, num_splits=2, block_h=8, interpret=True)
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(out2[1]))
    kv3 = kv.at[0, page, 0].set(3.0)  # ... but its own key matters
    out3 = paged_mla_attention(ql, qp, kv3, 0, sid, pos, pt, 0.2, num_splits=2, block_h=8, interpret=True)
    assert not np.allclose(np.asarray(out[1]), np.asarray(out3[1]))


@pytest.mark.parametrize("splits", [2, 4, 5])
def test_splits_follow_the_longest_context_not_the_table_width(splits):
    """A page table much wider than the contexts (a long max_model_len): the pages per split come from
    the longest context in the batch, so every page of every sequence is still visited exactly once."""
    ql, qp, kv, sid, pos, pt = _case(3)
    wide = jnp.zeros((3, 40), jnp.int32).at[:, :6].set(pt)
    ref = paged_mla_attention_reference(ql, qp, kv, 1, sid, pos, pt, 0.17)
    out = paged_mla_attention(ql, qp, kv, 1, sid, pos, wide, 0.17, num_splits=splits, block_h=8, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=2e-6)


def test_auto_splits_spread_small_batches_and_keep_large_ones_whole():
    from deepinfer_jax.kernels.mla_decode import auto_splits

    assert [auto_splits(t) for t in (1, 2, 8, 16, 32, 64, 128, 256, 8192)] == [128, 64, 16, 8, 4, 2, 1, 1, 1]
    assert [auto_splits(t, 16) for t in (1, 8, 16)] == [16, 16, 8]  # the GQA kernel's cap
    ql, qp, kv, sid, pos, pt = _case(4, T=1)  # one token: the auto default splits its 3 pages
    ref = paged_mla_attention_reference(ql, qp, kv, 0, sid, pos, pt, 0.17)
    out = paged_mla_attention(ql, qp, kv, 0, sid, pos, pt, 0.17, block_h=8, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("pages_per_step", [2, 3, 4])
@pytest.mark.parametrize("splits", [1, 2, 3])
def test_several_pages_per_step_match_the_reference(pages_per_step, splits):
    """Walking g pages per loop step (groups straddling a split's end are masked there) gives the
    reference's output: every page of every sequence counted exactly once."""
    ql, qp, kv, sid, pos, pt = _case(5)
    wide = jnp.zeros((3, 11), jnp.int32).at[:, :6].set(pt)  # groups may reach past the table's used part
    for layer in (0, 2):
        ref = paged_mla_attention_reference(ql, qp, kv, layer, sid, pos, pt, 0.17)
        out = paged_mla_attention(ql, qp, kv, layer, sid, pos, wide, 0.17, num_splits=splits, block_h=4,
                                  pages_per_step=pages_per_step, interpret=True)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=2e-6)


def test_several_pages_per_step_ignore_the_next_splits_pages():
    """One sequence of 6 pages in 3 splits of 2, 4 pages a step: each split's group runs into the next
    split's pages, which it must mask, or the merge would count them twice."""
    ql, qp, kv, sid, pos, pt = _case(6, T=1)
    sid, pos = jnp.array([2], jnp.int32), jnp.array([47], jnp.int32)  # 6 pages, 3 splits of 2 pages
    ref = paged_mla_attention_reference(ql, qp, kv, 1, sid, pos, pt, 0.17)
    out = paged_mla_attention(ql, qp, kv, 1, sid, pos, pt, 0.17, num_splits=3, block_h=4, pages_per_step=4,
                              interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("prefetch_ids", [False, True])
@pytest.mark.parametrize("block_keys", [2, 4, 8])
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_key_blocks_smaller_than_a_page_match_the_reference(block_keys, splits, prefetch_ids):
    """Reading a page in block_keys-key slices (splits then count slices, not pages), with the next block's
    page id loaded a step ahead or not: every key of every sequence counted exactly once, a sequence's last
    slice masked past its position."""
    _matches_reference(7, num_splits=splits, block_h=4, block_keys=block_keys, prefetch_ids=prefetch_ids)


def _matches_reference(seed, **kw):
    """paged_mla_attention(**kw) in interpret mode equals the reference on `_case(seed)` at two layers (fp32)."""
    ql, qp, kv, sid, pos, pt = _case(seed)
    for layer in (0, 2):
        ref = paged_mla_attention_reference(ql, qp, kv, layer, sid, pos, pt, 0.17)
        out = paged_mla_attention(ql, qp, kv, layer, sid, pos, pt, 0.17, interpret=True, **kw)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("qk_chunks", [1, 2, 4])
@pytest.mark.parametrize("block_keys, splits", [(4, 1), (4, 3), (8, 7)])
def test_latent_in_column_chunks_matches_the_reference(qk_chunks, block_keys, splits):
    """qk_chunks: each key block's scores as a sum of independent dots over column chunks of the latent and
    the values' product per chunk (`page_scores`, `softmax_steps`): the reference's output, every chunk stored in its columns
    (1: one dot, as before; the default, None, is mla_decode.QK_CHUNKS here). Chunks need the page id prefetch."""
    _matches_reference(8, num_splits=splits, block_h=4, block_keys=block_keys, qk_chunks=qk_chunks)
    ql, qp, kv, sid, pos, pt = _case(8)
    with pytest.raises(ValueError, match="qk_chunks"):
        paged_mla_attention(ql, qp, kv, 0, sid, pos, pt, 0.17, qk_chunks=2, prefetch_ids=False, interpret=True)


def test_fp8_cache_matches_reference():
    """An e4m3 cache (scale 1.0): the kernel widens each loaded page to the query's dtype, as the reference
    widens its gather, so the fp32 results agree as closely as on an fp32 cache."""
    ql, qp, kv, sid, pos, pt = _case(4)
    kv8 = kv.astype(jnp.float8_e4m3fn)
    ref = paged_mla_attention_reference(ql, qp, kv8, 2, sid, pos, pt, 0.17)
    out = paged_mla_attention(ql, qp, kv8, 2, sid, pos, pt, 0.17, num_splits=3, block_h=4, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=2e-6)
