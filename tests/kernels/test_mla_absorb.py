"""The decode query's absorption and RoPE kernel (interpret mode): q read out of the whole q projection
and W_UK out of one layer of the stacked kv_b_proj, both in place, equal to the pure-JAX reference,
which equals the model's XLA absorption (`mla.absorb_query`) and RoPE (`layers.apply_rope`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels.mla_absorb import absorb_query, absorb_query_reference, supported


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
