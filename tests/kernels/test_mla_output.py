"""The decode attention's output kernel (interpret mode): the context splits merged and W_UV applied,
reading one layer of the stacked kv_b_proj in place, equal to the pure-JAX merge and einsum."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels.mla_decode import NEG, paged_mla_attention, paged_mla_attention_splits
from deepinfer_jax.kernels.mla_output import merge_value_projection, merge_value_projection_reference, supported
from deepinfer_jax.kernels.mla_reference import paged_mla_attention_reference


def _kv_b(rng, L, R, H, dn, dv, dtype):
    return jnp.asarray(rng.standard_normal((L, R, H, dn + dv)) * 0.1, dtype)


@pytest.mark.parametrize("T, nh, S, bh, dtype", [
    (16, 1, 4, 8, jnp.float32),  # one head block, four splits
    (32, 2, 3, 4, jnp.float32),  # two head blocks (heads h = hb * bh + i), two token blocks, odd splits
    (16, 1, 1, 8, jnp.bfloat16),  # one split; bf16 latent and weights, fp32 accumulation
])
def test_kernel_matches_reference(T, nh, S, bh, dtype):
    rng = np.random.default_rng(T + nh + S)
    R, dn, dv, L = 32, 16, 32, 3
    o = jnp.asarray(rng.standard_normal((T, nh, S, bh, R)), jnp.float32)
    m = jnp.asarray(rng.standard_normal((T, nh, S, bh)), jnp.float32)
    l = jnp.asarray(rng.uniform(0.5, 3.0, (T, nh, S, bh)), jnp.float32)
    if S > 1:  # the last split of every other token is past its sequence's pages: empty
        empty = np.zeros((T, nh, S, bh), bool)
        empty[::2, :, -1] = True
        o = jnp.where(empty[..., None], 0.0, o)
        m, l = jnp.where(empty, NEG, m), jnp.where(empty, 0.0, l)
    kv_b = _kv_b(rng, L, R, nh * bh, dn, dv, dtype)
    for layer in (0, 2):
        got = merge_value_projection(o, m, l, kv_b, layer, dn=dn, dtype=dtype, block_v=16, block_r=16,
                                     interpret=True)
        want = merge_value_projection_reference(o, m, l, kv_b, layer, dn=dn, dtype=dtype)
        assert got.shape == (T, nh * bh, dv) and got.dtype == dtype
        tol = 1e-5 if dtype == jnp.float32 else 2e-2
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    # Another layer's W_UV gives another result: the layer index is honoured.
    other = merge_value_projection(o, m, l, kv_b, 1, dn=dn, dtype=dtype, block_v=16, interpret=True)
    assert not np.allclose(np.asarray(other, np.float32), np.asarray(want, np.float32), atol=1e-2)


def test_after_the_attention_kernel_equals_attention_then_einsum():
    """The decode kernel's splits through this kernel = the merged attention output (and the pure-JAX
    reference attention) times W_UV: what the model computed before in two steps."""
    rng = np.random.default_rng(5)
    T, H, R, dr, ps, L, dn, dv = 16, 8, 64, 16, 8, 2, 16, 32
    ql = jnp.asarray(rng.standard_normal((T, H, R)), jnp.float32)
    qp = jnp.asarray(rng.standard_normal((T, H, dr)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((L, 24, ps, R + dr)), jnp.float32)
    pt = jnp.asarray(rng.permutation(np.arange(1, 24))[:20].reshape(4, 5), jnp.int32)
    sid = jnp.asarray(np.arange(T) % 4, jnp.int32)
    pos = jnp.asarray(rng.integers(0, 40, T), jnp.int32)  # some sequences shorter than a split's share
    kv_b = _kv_b(rng, 3, R, H, dn, dv, jnp.float32)
    o, m, l = paged_mla_attention_splits(ql, qp, kv, 1, sid, pos, pt, 0.2, num_splits=4, block_h=4, interpret=True)
    got = merge_value_projection(o, m, l, kv_b, 2, dn=dn, dtype=jnp.float32, interpret=True)
    w_uv = kv_b[2, :, :, dn:]
    for o_lat in (paged_mla_attention(ql, qp, kv, 1, sid, pos, pt, 0.2, num_splits=4, block_h=4, interpret=True),
                  paged_mla_attention_reference(ql, qp, kv, 1, sid, pos, pt, 0.2)):
        want = jnp.einsum("thr,rhv->thv", o_lat, w_uv, precision=jax.lax.Precision.HIGHEST)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_supported_steps():
    assert supported(16, 128) and supported(64, 128)
    assert not supported(8, 128)  # fewer rows than Triton's dot takes: the model keeps XLA's merge
    assert not supported(24, 128)


@pytest.mark.parametrize("S", [4, 8])
def test_merge_slices_follow_the_split_count(S):
    """The default slice of the latent a program merges a step (`merge_slice`): 64 columns up to four splits, 32
    above; either way the reference's result (fp32), and the same as the other slice width up to fp32 sums."""
    from deepinfer_jax.kernels.mla_output import merge_slice

    assert merge_slice(S) == (64 if S <= 4 else 32)
    rng = np.random.default_rng(S)
    T, nh, bh, R, dn, dv, L = 16, 1, 16, 128, 16, 32, 2
    o = jnp.asarray(rng.standard_normal((T, nh, S, bh, R)), jnp.float32)
    m = jnp.asarray(rng.standard_normal((T, nh, S, bh)), jnp.float32)
    l = jnp.asarray(rng.uniform(0.5, 3.0, (T, nh, S, bh)), jnp.float32)
    kv_b = jnp.asarray(rng.standard_normal((L, R, nh * bh, dn + dv)), jnp.float32)
    want = merge_value_projection_reference(o, m, l, kv_b, 1, dn=dn, dtype=jnp.float32)
    got = merge_value_projection(o, m, l, kv_b, 1, dn=dn, dtype=jnp.float32, interpret=True)
    other = merge_value_projection(o, m, l, kv_b, 1, dn=dn, dtype=jnp.float32, block_r=96 - merge_slice(S),
                                   interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(other), rtol=1e-5, atol=1e-5)
