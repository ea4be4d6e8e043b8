"""The q / kv_a projections, the query's absorption and the latents' cache write in one launch (interpret
mode): equal to the two projections followed by `mla_absorb.absorb_query_write_latents` (bit for bit where
the GEMM's sums are exact, whatever their order), and to the pure-JAX reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels.mla_absorb import absorb_query_write_latents
from deepinfer_jax.kernels.mla_qkv import (plan, project_absorb_write_latents, project_absorb_write_latents_reference,
                                           supported)


def _inputs(rng, T, H, dn, dr, R, D, dtype, integer, n_real=None, page_size=8, num_pages=6, L=3, Lc=4):
    """A step's operands: x, w_q [L, D, H, dn + dr], w_kv [L, D, R + dr], kv_b, cos / sin, norm_w, cache, slots.
    `integer`: x and the projections' weights small integers, so that every GEMM sum is exact in fp32. The
    first n_real tokens take distinct slots of pages 1..; the rest are padding in null-page slots."""
    n_real = T if n_real is None else n_real
    draw = (lambda *s: rng.integers(-2, 3, s)) if integer else (lambda *s: rng.standard_normal(s) * 0.2)
    x = jnp.asarray(draw(T, D), dtype)
    w_q = jnp.asarray(draw(L, D, H, dn + dr), dtype)
    w_kv = jnp.asarray(draw(L, D, R + dr), dtype)
    kv_b = jnp.asarray(rng.standard_normal((L, R, H, 2 * dn)) * 0.1, dtype)
    angles = rng.uniform(0, 6.3, (T, dr // 2))
    cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
    norm_w = jnp.asarray(1.0 + 0.3 * rng.standard_normal((L, R)), dtype)
    cache = jnp.asarray(rng.standard_normal((Lc, num_pages, page_size, R + dr)), dtype)
    real = rng.permutation(np.arange(page_size, num_pages * page_size))[:n_real]
    slots = jnp.asarray(np.concatenate([real, np.arange(n_real, T) % page_size]), jnp.int32)
    return x, w_q, w_kv, kv_b, cos, sin, norm_w, cache, slots


def _as_f32(*arrays):
    return [np.asarray(a, np.float32) for a in arrays]


@pytest.mark.parametrize("T, H, dn, dr, R, D, dtype, tiles", [
    (16, 2, 16, 16, 32, 128, jnp.float32, {}),  # block_n 16: two tiles a head, three for the latent; 2 K chunks
    (16, 2, 16, 16, 32, 128, jnp.bfloat16, {"block_k": 16, "split_k": 4}),  # 4 chunks of two K steps each
    (32, 3, 32, 16, 64, 64, jnp.bfloat16, {"split_k": 1}),  # 48-wide heads in 16-wide tiles, one K chunk
])
def test_equals_the_projections_then_the_absorb_launch(T, H, dn, dr, R, D, dtype, tiles):
    """With exact GEMM sums: q_lat, q_pe and the whole cache bit for bit as absorb_query_write_latents on the
    XLA projections' q and ckv, for layers 0 and 2 into cache layers 3 and 1; the reference agrees."""
    rng = np.random.default_rng(T + H + D)
    x, w_q, w_kv, kv_b, cos, sin, norm_w, cache, slots = _inputs(rng, T, H, dn, dr, R, D, dtype, integer=True,
                                                                 n_real=T - 5)
    for layer, cache_layer in ((0, 3), (2, 1)):
        got = project_absorb_write_latents(x, w_q, w_kv, layer, kv_b, cos, sin, norm_w, cache, cache_layer, slots,
                                           dn=dn, eps=1e-6, interpret=True, **tiles)
        q = jnp.einsum("td,dhk->thk", x, w_q[layer], preferred_element_type=jnp.float32).astype(dtype)
        ckv = jnp.dot(x, w_kv[layer], preferred_element_type=jnp.float32).astype(dtype)
        want = absorb_query_write_latents(q, kv_b, layer, cos, sin, ckv, norm_w, cache, cache_layer, slots, dn=dn,
                                          eps=1e-6, interpret=True)
        assert [g.shape for g in got] == [(T, H, R), (T, H, dr), cache.shape]
        assert [g.dtype for g in got] == [dtype, dtype, cache.dtype]
        for g, w in zip(_as_f32(*got), _as_f32(*want)):
            np.testing.assert_array_equal(g, w)
        ref = jax.jit(project_absorb_write_latents_reference, static_argnames=("dn", "eps"))(
            x, w_q, w_kv, layer, kv_b, cos, sin, norm_w, cache, cache_layer, slots, dn=dn, eps=1e-6)
        np.testing.assert_array_equal(_as_f32(got[2])[0], _as_f32(ref[2])[0])
        tol = 1e-5 if dtype == jnp.float32 else 2e-2
        for g, w in zip(_as_f32(*got[:2]), _as_f32(*ref[:2])):
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol * np.abs(w).max())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_the_reference_with_inexact_sums(dtype):
    """Random weights (the GEMM's sums rounded in another order than XLA's): within fp32 / bf16 rounding of the
    reference, the cache's untouched entries unchanged."""
    rng = np.random.default_rng(7)
    T, H, dn, dr, R, D = 16, 2, 16, 16, 32, 256
    args = _inputs(rng, T, H, dn, dr, R, D, dtype, integer=False)
    x, w_q, w_kv, kv_b, cos, sin, norm_w, cache, slots = args
    got = project_absorb_write_latents(x, w_q, w_kv, 1, kv_b, cos, sin, norm_w, cache, 2, slots, dn=dn, eps=1e-6,
                                       interpret=True)
    want = project_absorb_write_latents_reference(x, w_q, w_kv, 1, kv_b, cos, sin, norm_w, cache, 2, slots, dn=dn,
                                                  eps=1e-6)
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    for g, w in zip(_as_f32(*got), _as_f32(*want)):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)
    written = np.zeros(cache.shape[:3], bool)
    written[2, np.asarray(slots) // 8, np.asarray(slots) % 8] = True
    np.testing.assert_array_equal(_as_f32(got[2])[0][~written], _as_f32(cache)[0][~written])


def test_plan_and_supported_sizes():
    # V2-Lite: 16 heads of 128 + 64, a 512 + 64 latent, D 2048: 64-wide tiles (gcd 192, 576), 57 of them in 4 chunks.
    assert plan(2048, 16, 192, 576) == (64, 64, 4)
    assert supported(32, 2048, 16, 128, 64, 512) and not supported(8, 2048, 16, 128, 64, 512)
    # The tiny test models (heads 16 + 8, latent 32 + 8): 8-wide tiles, which only interpret mode takes.
    assert plan(64, 4, 24, 40) is None and plan(64, 4, 24, 40, interpret=True) == (8, 64, 1)
    assert supported(16, 64, 4, 16, 8, 32, interpret=True) and not supported(16, 64, 4, 16, 8, 32)
