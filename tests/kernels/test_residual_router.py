"""The o_proj -> router kernel (interpret mode): o_proj's split-K partials added to the residual, the
RMSNorm and the router's logits equal the pure-JAX reference, which equals the model's own functions
(`layers.rms_norm`, `moe.router_logits`, the split-K sum of `decode_matmul`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels.decode_matmul import decode_matmul
from deepinfer_jax.kernels.residual_router import (
    residual_norm_router, residual_norm_router_reference, supported)


def _case(seed, S, Tp, T, D, E, L, dtype, norm_dtype=None):
    rng = np.random.default_rng(seed)
    parts = jnp.asarray(rng.standard_normal((S, Tp, D)), jnp.float32)
    parts = parts.at[:, T:].set(jnp.nan)  # rows past T: never read
    h = jnp.asarray(rng.standard_normal((T, D)) * 2, dtype)
    norm_w = jnp.asarray(rng.standard_normal((L, D)) * 0.3 + 1, norm_dtype or dtype)
    gate = jnp.asarray(rng.standard_normal((L, D, E)) * 0.1, dtype)
    return parts, h, norm_w, gate


@pytest.mark.parametrize("S, Tp, T, D, E, block_d, block_e, dtype, norm_dtype", [
    (8, 16, 5, 64, 16, 16, 8, jnp.float32, None),  # 8 partials, 4 chunks, 2 expert blocks
    (1, 16, 16, 128, 8, 128, 16, jnp.float32, None),  # one partial, one chunk, block_e clipped to E
    (3, 32, 32, 64, 16, 32, 16, jnp.bfloat16, None),  # bf16 residual, norm and gate
    (2, 16, 7, 64, 8, 16, 8, jnp.bfloat16, jnp.float32),  # an fp32 norm weight: x in fp32 (promoted)
])
def test_kernel_matches_reference(S, Tp, T, D, E, block_d, block_e, dtype, norm_dtype):
    parts, h, norm_w, gate = _case(S + T + D, S, Tp, T, D, E, 3, dtype, norm_dtype)
    for layer in (0, 2):
        got = residual_norm_router(parts, h, norm_w, gate, layer, eps=1e-6, block_d=block_d, block_e=block_e,
                                   interpret=True)
        want = residual_norm_router_reference(parts, h, norm_w, gate, layer, eps=1e-6)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
        # Up to fp32 summation order (the partials', the RMS's), then rounding to the dtype.
        tol = 2e-6 if dtype == jnp.float32 else 1e-2
        for g, w in zip(got[:2], want[:2]):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)
        np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-5, atol=1e-5)
        assert not np.isnan(np.asarray(got[2])).any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_is_the_models_arithmetic(dtype):
    """The reference equals o_proj through decode_matmul (reduced), the residual add, `rms_norm` and
    `router_logits` as the model's layer body computes them."""
    from deepinfer_jax.models.layers import rms_norm
    from deepinfer_jax.models.moe import router_logits

    rng = np.random.default_rng(3)
    T, K, D, E, L = 16, 64, 64, 8, 2
    a = jnp.asarray(rng.standard_normal((T, K)), dtype)
    w = jnp.asarray(rng.standard_normal((L, K, D)) * 0.2, dtype)
    _, h, norm_w, gate = _case(4, 1, T, T, D, E, L, dtype)
    parts = decode_matmul(a, w, 1, block_n=16, block_k=16, split_k=2, reduce=False, interpret=True)
    assert parts.shape == (2, T, D)
    want_h = h + decode_matmul(a, w, 1, block_n=16, block_k=16, split_k=2, interpret=True).astype(dtype)
    want_x = rms_norm(want_h, norm_w[1], 1e-6)
    want_logits = router_logits({"gate": gate[1]}, want_x)
    got_h, got_x, got_logits = residual_norm_router_reference(parts, h, norm_w, gate, 1, eps=1e-6)
    np.testing.assert_array_equal(np.asarray(got_h, np.float32), np.asarray(want_h, np.float32))
    np.testing.assert_array_equal(np.asarray(got_x, np.float32), np.asarray(want_x, np.float32))
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), rtol=1e-5, atol=1e-5)


def test_supported_shapes():
    assert supported(2048, 64) and supported(64, 8)
    assert not supported(2048, 72) and not supported(7168 // 7 * 6, 256)


def test_jit_lowers_once_per_layer_index():
    """The layer index is an operand: every layer of a segment shares one kernel."""
    parts, h, norm_w, gate = _case(5, 2, 16, 16, 64, 8, 3, jnp.float32)
    traced = jax.jit(lambda l: residual_norm_router(parts, h, norm_w, gate, l, eps=1e-6, interpret=True))
    outs = [traced(jnp.int32(layer)) for layer in range(3)]
    assert traced._cache_size() == 1
    assert not np.allclose(np.asarray(outs[0][2]), np.asarray(outs[2][2]))
