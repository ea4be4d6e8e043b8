"""The decode query's absorption and RoPE kernel (interpret mode): q read out of the whole q projection
and W_UK out of one layer of the stacked kv_b_proj, both in place, equal to the pure-JAX reference,
which equals the model's XLA absorption (`mla.absorb_query`) and RoPE (`layers.apply_rope`). Its variant
that also norms, ropes and writes the step's latents into the paged cache (`absorb_query_write_latents`)
writes exactly what the model's XLA path writes (`rms_norm`, `apply_rope`, `write_latents`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels.mla_absorb import (absorb_query, absorb_query_reference,
                                              absorb_query_write_latents, absorb_query_write_latents_reference,
                                              latent_supported, supported)


def _rope(rng, T, dr):
    angles = rng.uniform(0, 6.3, (T, dr // 2))
    return jnp.asarray(np.cos(angles) * 1.3, jnp.float32), jnp.asarray(np.sin(angles) * 1.3, jnp.float32)


@pytest.mark.parametrize("T, H, dn, dr, R, dv, block_r, dtype", [
    (16, 4, 16, 8, 32, 16, 16, jnp.float32),  # two latent tiles a head
    (32, 2, 32, 16, 64, 32, 64, jnp.float32),  # 32 token rows in one dot, one tile
    (16, 3, 16, 8, 32, 16, 32, jnp.bfloat16),  # bf16 q and weights, fp32 accumulation, rounded like XLA
])
def test_kernel_matches_reference(T, H, dn, dr, R, dv, block_r, dtype):
    rng = np.random.default_rng(T + H + R)
    L = 3
    q = jnp.asarray(rng.standard_normal((T, H, dn + dr)), dtype)
    kv_b = jnp.asarray(rng.standard_normal((L, R, H, dn + dv)) * 0.1, dtype)
    cos, sin = _rope(rng, T, dr)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for layer in (0, 2):
        got = absorb_query(q, kv_b, layer, cos, sin, dn=dn, block_r=block_r, interpret=True)
        want = absorb_query_reference(q, kv_b, layer, cos, sin, dn=dn)
        assert got[0].shape == (T, H, R) and got[1].shape == (T, H, dr) and got[0].dtype == got[1].dtype == dtype
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)
    # W_UV takes no part; q's rope part only in q_pe, q's nope part only in q_lat.
    base = absorb_query(q, kv_b, 1, cos, sin, dn=dn, block_r=block_r, interpret=True)
    other = absorb_query(q.at[..., dn:].set(7.0), kv_b.at[..., dn:].set(-3.0), 1, cos, sin, dn=dn, block_r=block_r,
                         interpret=True)
    np.testing.assert_array_equal(np.asarray(other[0]), np.asarray(base[0]))
    assert not np.array_equal(np.asarray(other[1]), np.asarray(base[1]))
    other = absorb_query(q.at[..., :dn].set(7.0), kv_b, 1, cos, sin, dn=dn, block_r=block_r, interpret=True)
    np.testing.assert_array_equal(np.asarray(other[1]), np.asarray(base[1]))


def test_reference_is_the_models_absorption_and_rope(hf_case):
    """absorb_query_reference on layer j of a stacked kv_b equals models/mla.py's absorb_query on that
    layer's kv_b_proj, in both of its forms (the W_UK slice and the zero-padded whole rows), and
    models/layers.py's apply_rope with rope_cos_sin at the tokens' positions."""
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.models import mla
    from deepinfer_jax.models.layers import apply_rope, rope_cos_sin

    _, path = hf_case("v2_greedy_yarn")
    cfg = ModelConfig.from_model_dir(path)
    H, dn, dr, dv, R = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                        cfg.kv_lora_rank)
    rng = np.random.default_rng(5)
    kv_b = jnp.asarray(rng.standard_normal((2, R, H, dn + dv)), jnp.float32)
    for T in (16, 128):  # 128 > ABSORB_FULL_WIDTH_MAX_TOKENS: the slice form
        q = jnp.asarray(rng.standard_normal((T, H, dn + dr)), jnp.float32)
        cos, sin = rope_cos_sin(cfg, jnp.asarray(rng.integers(0, 4000, T)))
        q_lat, q_pe = absorb_query_reference(q, kv_b, 1, cos, sin, dn=dn)
        want = mla.absorb_query({"kv_b_proj": kv_b[1]}, cfg, q[..., :dn])
        np.testing.assert_allclose(np.asarray(q_lat), np.asarray(want), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(q_pe), np.asarray(apply_rope(q[..., dn:], cos, sin)), rtol=1e-6,
                                   atol=1e-6)


def test_supported_sizes():
    assert supported(16, 128, 64, 512) and supported(64, 128, 64, 512)
    assert not supported(8, 128, 64, 512)  # fewer rows than Triton's dot needs
    assert not supported(16, 96, 64, 512)  # dn not a power of two
    assert not supported(16, 128, 48, 512)  # dr / 2 not a power of two


def _latent_step(rng, T, n_real, page_size, num_pages, dtype, H=2, dn=16, dr=8, R=32, dv=16, L=3, Lc=4):
    """Inputs of absorb_query_write_latents for T token slots, the first n_real of them real tokens in
    distinct slots of pages 1.., the rest padding as runner/inputs.py lays it out: slots
    `arange(T) % page_size` of the null page, all with the same row (token 0 at position 0)."""
    q = jnp.asarray(rng.standard_normal((T, H, dn + dr)), dtype)
    kv_b = jnp.asarray(rng.standard_normal((L, R, H, dn + dv)) * 0.1, dtype)
    angles = rng.uniform(0, 6.3, (T, dr // 2))
    angles[n_real:] = 0.0
    cos, sin = jnp.asarray(np.cos(angles) * 1.3, jnp.float32), jnp.asarray(np.sin(angles) * 1.3, jnp.float32)
    ckv = rng.standard_normal((T, R + dr)) * 3
    ckv[n_real:] = ckv[n_real:n_real + 1]  # padding rows: one row repeated
    norm_w = jnp.asarray(1.0 + 0.3 * rng.standard_normal((L, R)), dtype)
    cache = jnp.asarray(rng.standard_normal((Lc, num_pages, page_size, R + dr)), dtype)
    real = rng.permutation(np.arange(page_size, num_pages * page_size))[:n_real]
    slots = np.concatenate([real, np.arange(n_real, T) % page_size]).astype(np.int32)
    return q, kv_b, cos, sin, jnp.asarray(ckv, dtype), norm_w, cache, jnp.asarray(slots), dn


@pytest.mark.parametrize("T, n_real, page_size, num_pages, dtype", [
    (16, 16, 64, 3, jnp.float32),  # no padding
    (32, 21, 64, 3, jnp.bfloat16),  # 11 padding tokens in distinct slots of the null page
    (16, 11, 4, 9, jnp.float32),  # small pages: padding tokens share null-page slots, with equal rows
    (32, 29, 4, 12, jnp.bfloat16),
])
def test_latents_written_as_the_models_xla_path_writes_them(T, n_real, page_size, num_pages, dtype):
    """The kernel's cache equals (bit for bit) the model's path, jitted as in a step: write_latents of
    concat(rms_norm(c_kv), apply_rope(k_pe)) cast to the cache's dtype, at layer `cache_layer`; every other
    value of the cache is unchanged. The query's outputs are absorb_query's, bit for bit; the pure-JAX
    reference agrees with both."""
    from deepinfer_jax.models.cache import StepMetadata
    from deepinfer_jax.models.deepseek import write_latents
    from deepinfer_jax.models.layers import apply_rope, rms_norm

    rng = np.random.default_rng(T + n_real + page_size)
    q, kv_b, cos, sin, ckv, norm_w, cache, slots, dn = _latent_step(rng, T, n_real, page_size, num_pages, dtype)
    R, eps, layer, cache_layer = norm_w.shape[1], 1e-6, 2, 3
    meta = StepMetadata(*(jnp.zeros(T, jnp.int32),) * 3, slots, jnp.zeros((1, 1), jnp.int32), jnp.zeros(1, jnp.int32))

    @jax.jit
    def model_path(cache, ckv, norm_w, cos, sin):
        c_kv, k_pe = rms_norm(ckv[:, :R], norm_w[layer], eps), apply_rope(ckv[:, R:], cos, sin)
        return write_latents(cache, cache_layer, meta, jnp.concatenate([c_kv, k_pe], axis=-1).astype(cache.dtype))

    q_lat, q_pe, got = absorb_query_write_latents(q, kv_b, layer, cos, sin, ckv, norm_w, cache, cache_layer, slots,
                                                  dn=dn, eps=eps, interpret=True)
    want = model_path(cache, ckv, norm_w, cos, sin)
    assert got.shape == cache.shape and got.dtype == cache.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    written = np.zeros(cache.shape[:3], bool)
    written[cache_layer, np.asarray(slots) // page_size, np.asarray(slots) % page_size] = True
    np.testing.assert_array_equal(np.asarray(got, np.float32)[~written], np.asarray(cache, np.float32)[~written])
    assert not np.array_equal(np.asarray(got, np.float32)[written], np.asarray(cache, np.float32)[written])
    for g, w in zip((q_lat, q_pe), absorb_query(q, kv_b, layer, cos, sin, dn=dn, interpret=True)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    ref = jax.jit(absorb_query_write_latents_reference, static_argnames=("dn", "eps"))(
        q, kv_b, layer, cos, sin, ckv, norm_w, cache, cache_layer, slots, dn=dn, eps=eps)
    np.testing.assert_array_equal(np.asarray(ref[2], np.float32), np.asarray(want, np.float32))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for g, w in zip((q_lat, q_pe), ref[:2]):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("T, n_real, page_size, num_pages, dtype", [(16, 16, 64, 3, jnp.float32),
                                                                     (32, 21, 4, 12, jnp.bfloat16)])
def test_merged_projection_read_in_place_equals_the_two_operands(T, n_real, page_size, num_pages, dtype):
    """ckv None, q the merged q / kv_a projection [T, H * (dn + dr) + R + dr] (one operand, XLA's GEMM output as
    it is): q_lat, q_pe and the whole cache bit for bit as with q [T, H, dn + dr] and ckv [T, R + dr] sliced out of
    it; the reference takes the merged form too."""
    rng = np.random.default_rng(T + page_size)
    q, kv_b, cos, sin, ckv, norm_w, cache, slots, dn = _latent_step(rng, T, n_real, page_size, num_pages, dtype)
    merged = jnp.concatenate([q.reshape(T, -1), ckv], axis=1)
    rest = (norm_w, cache, 3, slots)
    want = absorb_query_write_latents(q, kv_b, 2, cos, sin, ckv, *rest, dn=dn, eps=1e-6, interpret=True)
    got = absorb_query_write_latents(merged, kv_b, 2, cos, sin, None, *rest, dn=dn, eps=1e-6, interpret=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    ref = jax.jit(absorb_query_write_latents_reference, static_argnames=("dn", "eps"))
    for g, w in zip(ref(merged, kv_b, 2, cos, sin, None, *rest, dn=dn, eps=1e-6),
                    ref(q, kv_b, 2, cos, sin, ckv, *rest, dn=dn, eps=1e-6)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    with pytest.raises(AssertionError):  # a merged operand of the wrong width
        absorb_query_write_latents(merged[:, :-2], kv_b, 2, cos, sin, None, *rest, dn=dn, eps=1e-6, interpret=True)


def test_latents_in_the_promoted_dtype_of_norm_and_activations():
    """An fp32 norm weight with bf16 activations: rms_norm's product is fp32, rounded once to the cache's
    dtype (bf16 or fp32), as the model's concat then cast does."""
    rng = np.random.default_rng(3)
    T, page_size = 16, 8
    q, kv_b, cos, sin, ckv, norm_w, cache, slots, dn = _latent_step(rng, T, 12, page_size, 4, jnp.bfloat16)
    for cache_dtype in (jnp.bfloat16, jnp.float32):
        args = (q, kv_b, 1, cos, sin, ckv, norm_w.astype(jnp.float32), cache.astype(cache_dtype), 0, slots)
        got = absorb_query_write_latents(*args, dn=dn, eps=1e-5, interpret=True)[2]
        want = jax.jit(absorb_query_write_latents_reference, static_argnames=("dn", "eps"))(*args, dn=dn, eps=1e-5)[2]
        assert got.dtype == cache_dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_latent_supported_sizes():
    assert latent_supported(32, 128, 64, 512) and not latent_supported(32, 128, 64, 384)  # R a power of two
    assert not latent_supported(8, 128, 64, 512)


def test_latents_into_an_fp8_cache_saturate_as_the_model_writes_them():
    """An e4m3 cache: the kernel stores the latents as models/cache.py `to_cache_dtype` does, bit for bit,
    saturating at +-448 (some latent columns here are far beyond it) rather than writing NaN."""
    from deepinfer_jax.models.cache import StepMetadata, to_cache_dtype
    from deepinfer_jax.models.deepseek import write_latents
    from deepinfer_jax.models.layers import apply_rope, rms_norm

    f8 = jnp.float8_e4m3fn
    q, kv_b, cos, sin, ckv, norm_w, cache, slots, dn = _latent_step(np.random.default_rng(8), 16, 11, 4, 9,
                                                                      jnp.float32)
    norm_w = norm_w.at[:, :4].multiply(500.0)
    cache = to_cache_dtype(cache, f8)
    R, eps, layer, cache_layer, T = norm_w.shape[1], 1e-6, 2, 3, 16
    meta = StepMetadata(*(jnp.zeros(T, jnp.int32),) * 3, slots, jnp.zeros((1, 1), jnp.int32), jnp.zeros(1, jnp.int32))
    c_kv, k_pe = rms_norm(ckv[:, :R], norm_w[layer], eps), apply_rope(ckv[:, R:], cos, sin)
    want = write_latents(cache, cache_layer, meta, to_cache_dtype(jnp.concatenate([c_kv, k_pe], axis=-1), f8))
    got = absorb_query_write_latents(q, kv_b, layer, cos, sin, ckv, norm_w, cache, cache_layer, slots, dn=dn,
                                     eps=eps, interpret=True)[2]
    assert got.dtype == f8
    g = np.asarray(got, np.float32)
    np.testing.assert_array_equal(g, np.asarray(want, np.float32))
    assert not np.isnan(g).any() and (np.abs(g) == 448.0).any()
    ref = absorb_query_write_latents_reference(q, kv_b, layer, cos, sin, ckv, norm_w, cache, cache_layer, slots,
                                               dn=dn, eps=eps)[2]
    np.testing.assert_array_equal(np.asarray(ref, np.float32), g)
