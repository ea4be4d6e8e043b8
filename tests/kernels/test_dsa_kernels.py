"""DeepSeek Sparse Attention's kernels (interpret mode) equal the pure-JAX reference: the indexer's scores over
the paged keys, and sparse MLA over the selected keys; both lower to Triton at V3.2's shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels.dsa_indexer import paged_index_scores, select_topk
from deepinfer_jax.kernels.dsa_reference import index_scores, paged_dsa_attention_reference
from deepinfer_jax.kernels.mla_sparse import selected_slots, sparse_mla_attention

R, DR, DI, HI = 32, 16, 32, 16


def _case(seed, T=7, H=8, P=20, ps=8, L=3, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    ql, qp, iq = f(T, H, R), f(T, H, DR), f(T, HI, DI)
    iw = jnp.asarray(rng.standard_normal((T, HI)), jnp.float32)
    kv = f(L, P, ps, R + DR + DI)
    pages = rng.permutation(np.arange(1, P))
    pt = np.zeros((3, 6), np.int32)
    pt[0, :3], pt[1, :1], pt[2, :6] = pages[:3], pages[3:4], pages[4:10]
    sid = np.array([0, 1, 2, 2, 2, 2, 2][:T], np.int32)
    pos = np.array([20, 0, 40, 41, 42, 9, 47][:T], np.int32)
    return ql, qp, iq, iw, kv, jnp.asarray(sid), jnp.asarray(pos), jnp.asarray(pt)


def test_index_scores_match_reference():
    _, _, iq, iw, kv, sid, pos, pt = _case(0)
    layer = 2
    out = np.asarray(paged_index_scores(iq, iw, kv, layer, sid, pos, pt, key_start=R + DR, num_splits=3,
                                        interpret=True))
    keys = kv[layer, pt[sid]].reshape(sid.shape[0], -1, kv.shape[-1])[..., R + DR:]  # [T, max_len, Di]
    ref = np.asarray(index_scores(iq[:, None], iw[:, None], keys)[:, 0])
    visible = np.arange(ref.shape[1])[None] <= np.asarray(pos)[:, None]
    np.testing.assert_allclose(out[visible], ref[visible], rtol=1e-5, atol=1e-5)
    assert np.all(np.isneginf(out[~visible]))


@pytest.mark.parametrize("topk, block_keys", [(12, 8), (5, 32)])
def test_sparse_attention_matches_reference(topk, block_keys):
    ql, qp, iq, iw, kv, sid, pos, pt = _case(1)
    ps = kv.shape[2]
    for layer in (0, 2):
        ref = paged_dsa_attention_reference(ql, qp, iq, iw, kv, layer, sid, pos, pt, 0.17, DR, topk)
        scores = paged_index_scores(iq, iw, kv, layer, sid, pos, pt, key_start=R + DR, interpret=True)
        idx, valid = select_topk(scores, pos, topk)
        slots, ok = selected_slots(idx, valid, sid, pt, ps, block_keys)
        out = sparse_mla_attention(ql, qp, kv, layer, slots, ok, 0.17, block_h=4, block_keys=block_keys,
                                   interpret=True)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
    # Sparsity is real here: the token at position 47 attends to `topk` of its 48 keys.
    assert int(valid[-1].sum()) == topk


def test_kernels_lower_for_sm90(cuda_lowering):
    s = jax.ShapeDtypeStruct
    T, H, ps, L, P, topk = 16, 16, 64, 4, 4096, 2048
    cache = s((L, P, ps, 512 + 64 + 128), jnp.bfloat16)
    i32 = lambda *shape: s(shape, jnp.int32)  # noqa: E731
    cuda_lowering(lambda *a: paged_index_scores(*a, key_start=576), s((T, 64, 128), jnp.bfloat16),
                  s((T, 64), jnp.float32), cache, i32(), i32(T), i32(T), i32(T, 64))
    # DeepSeek-V4's csa group through models/v4_paged.py's shim: rows [compressed 512 | index key 128]
    cuda_lowering(lambda *a: paged_index_scores(*a, key_start=512), s((T, 64, 128), jnp.bfloat16),
                  s((T, 64), jnp.float32), s((1, P, ps, 512 + 128), jnp.bfloat16), i32(), i32(T), i32(T), i32(T, 64))
    cuda_lowering(lambda *a: sparse_mla_attention(*a, 0.1), s((T, H, 512), jnp.bfloat16),
                  s((T, H, 64), jnp.bfloat16), cache, i32(), i32(T, topk), i32(T, topk))
