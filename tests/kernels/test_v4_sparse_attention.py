"""DeepSeek-V4's sparse attention kernel (interpret mode) equals its pure-JAX reference: rows gathered from two
caches at each token's slots, invalid slots masked, the sink in the softmax; it lowers to Triton at V4-Flash's
shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.kernels.v4_sparse_attention import pad_slots, v4_sparse_attention, v4_sparse_attention_reference


def test_matches_reference_with_masks_and_sink():
    rng = np.random.default_rng(0)
    T, H, hd, na, nb = 5, 8, 16, 6, 11  # odd key counts: padded to the key block
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q, rows_a, rows_b, sinks = f(T, H, hd), f(30, hd), f(40, hd + 8), f(H)
    sa, sb = jnp.asarray(rng.integers(0, 30, (T, na))), jnp.asarray(rng.integers(0, 40, (T, nb)))
    va, vb = jnp.asarray(rng.random((T, na)) < 0.7), jnp.asarray(rng.random((T, nb)) < 0.5)
    vb = vb.at[0].set(False)  # a token with no `b` row
    va = va.at[1].set(False).at[2].set(False)
    vb = vb.at[2].set(False)  # a token with no row at all: the sink alone, o = 0
    ref = v4_sparse_attention_reference(q, rows_a, sa, va, rows_b, sb, vb, sinks, 0.3)
    a, b = pad_slots(sa, va, 8), pad_slots(sb, vb, 8)
    out = v4_sparse_attention(q, rows_a, *a, rows_b, *b, sinks, 0.3, block_h=4, block_keys=8, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
    assert np.all(np.asarray(out[2]) == 0)


def test_lowers_for_sm90(cuda_lowering):
    s = jax.ShapeDtypeStruct
    T, H, hd, n = 8, 64, 512, 128 + 512  # V4-Flash: window 128, top-512
    i32 = lambda *shape: s(shape, jnp.int32)  # noqa: E731
    cuda_lowering(lambda *a: v4_sparse_attention(*a, 0.04), s((T, H, hd), jnp.bfloat16),
                  s((4096 * 64, hd), jnp.bfloat16), i32(T, 128), i32(T, 128), s((4096 * 64, hd + 128), jnp.bfloat16),
                  i32(T, n - 128), i32(T, n - 128), s((H,), jnp.float32))
