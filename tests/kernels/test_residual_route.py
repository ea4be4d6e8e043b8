"""kernels/residual_route.py (interpret mode): o_proj's split-K partials to the residual, the post-attention
RMSNorm, the router's logits and the routing in one launch, against its pure-JAX reference, which is tied to the
model's own functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels.moe_route import route_align_reference
from deepinfer_jax.kernels.residual_route import residual_route, residual_route_reference, supported

NAMES = ("h_new", "x", "weights", "idx", "row_copy", "block_expert", "row_of")


def _case(T, D, E, L, dtype, bias, seed=0):
    rng = np.random.default_rng(seed + T + D + E)
    parts = jnp.asarray(rng.standard_normal((8, T, D)) * 0.3, jnp.float32)
    h = jnp.asarray(rng.standard_normal((T, D)), dtype)
    norm_w = jnp.asarray(rng.uniform(0.5, 1.5, (L, D)), dtype)
    gate = jnp.asarray(rng.standard_normal((L, D, E)) * 0.05, dtype)
    b = jnp.asarray(rng.random(E) * 0.1, jnp.float32) if bias else None
    return parts, h, norm_w, gate, b


@pytest.mark.parametrize("T, D, E, k, S, scoring, bias", [
    (32, 256, 64, 6, 2, "softmax", False),  # V2-Lite's routing at Protocol A's batch (D scaled down)
    (16, 128, 16, 4, 1, "sigmoid", True),  # noaux_tc's bias, one shared expert
    (16, 64, 8, 3, 0, "softmax", False),  # fewer experts than Triton's dot takes: the elementwise sums
])
def test_fp32_matches_reference(T, D, E, k, S, scoring, bias):
    parts, h, norm_w, gate, b = _case(T, D, E, 3, jnp.float32, bias)
    kw = dict(eps=1e-6, k=k, num_shared=S, block_m=16, scoring_func=scoring, norm_topk_prob=bias,
              routed_scaling_factor=2.5 if bias else 1.0)
    got = residual_route(parts, h, norm_w, gate, 1, b, interpret=True, **kw)
    want = jax.jit(lambda *a: residual_route_reference(*a, **kw))(parts, h, norm_w, gate, 1, b)
    for name, g, w in zip(NAMES, got, want):
        if name in ("h_new", "x", "weights"):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=2e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
    # Layer 1's weights, not another layer's: the stacked norm and gate are read at the index.
    other = residual_route(parts, h, norm_w, gate, 2, b, interpret=True, **kw)
    assert not np.allclose(np.asarray(other[1]), np.asarray(got[1]))


def test_bf16_rounds_like_the_layer_and_routes_its_own_x():
    """bf16: h_new and x within one bf16 step of the reference (XLA may keep o_proj's sum unrounded before
    the add: excess precision), and the routing is exactly the routing of the kernel's own x."""
    T, D, E, k, S = 32, 256, 64, 6, 2
    parts, h, norm_w, gate, _ = _case(T, D, E, 2, jnp.bfloat16, False, seed=3)
    kw = dict(eps=1e-6, k=k, num_shared=S, block_m=16)
    got = residual_route(parts, h, norm_w, gate, 1, interpret=True, **kw)
    want = residual_route_reference(parts, h, norm_w, gate, 1, **kw)
    for i in (0, 1):
        g, w = np.asarray(got[i], np.float32), np.asarray(want[i], np.float32)
        np.testing.assert_allclose(g, w, rtol=2 ** -7, atol=1e-2, err_msg=NAMES[i])
    logits = np.asarray(got[1], np.float32) @ np.asarray(gate[1], np.float32)  # exact bf16 products, fp32 sums
    routed = route_align_reference(jnp.asarray(logits), None, k=k, num_shared=S, block_m=16)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(routed[0]), rtol=1e-5, atol=1e-6)
    for name, g, w in list(zip(NAMES[2:], got[2:], routed))[1:]:
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


def test_reference_is_the_models_arithmetic():
    """The reference restates the layer: h + the reduced o_proj output, models/layers.py rms_norm and
    models/moe.py router_logits, then the routing kernel's reference."""
    from deepinfer_jax.models.layers import rms_norm
    from deepinfer_jax.models.moe import router_logits

    T, D, E = 16, 128, 16
    parts, h, norm_w, gate, _ = _case(T, D, E, 2, jnp.float32, False, seed=5)
    got = residual_route_reference(parts, h, norm_w, gate, 1, eps=1e-6, k=4, num_shared=1, block_m=16)
    h_new = h + parts.sum(axis=0).astype(h.dtype)
    x = rms_norm(h_new, norm_w[1], 1e-6)
    routed = route_align_reference(router_logits({"gate": gate[1]}, x), None, k=4, num_shared=1, block_m=16)
    for name, g, w in zip(NAMES, got, (h_new, x, *routed)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6, err_msg=name)


def test_supported_sizes():
    assert supported(32, 2048, 64, 6, 2)  # V2-Lite at batch 32
    assert not supported(8, 2048, 64, 6, 2)  # fewer rows than Triton's dot takes
    assert not supported(512, 2048, 64, 6, 2)  # past the routing kernel's copies
    assert not supported(32, 48, 64, 6, 2)  # K chunks under 16
    assert supported(256, 2048, 64, 6, 2)  # V2-Lite at batch 256: 8 router chunks


def test_router_chunks_keep_a_chunks_slices_in_shared_memory():
    """A router chunk's [T, D / C] slice of x and [D / C, E] slice of the gate stay within ROUTER_SMEM: V2-Lite in
    bf16 keeps 4 chunks up to 128 tokens (192 KiB, measured to compile) and takes 8 at 256 (4 chunks asked for 320
    KiB and failed to compile on an H200); fp32 takes more chunks sooner; D / C stays at least 16."""
    from deepinfer_jax.kernels.residual_route import ROUTER_SMEM, router_chunks

    assert [router_chunks(t, 2048, 64) for t in (16, 32, 64, 128, 256)] == [4, 4, 4, 4, 8]
    assert [router_chunks(t, 2048, 64, 4, 4) for t in (16, 64, 128, 256)] == [4, 8, 8, 16]
    assert [router_chunks(t, 7168, 256) for t in (16, 128)] == [32, 32]  # V3's D and experts: the gate's slices
    for t in (16, 64, 128):
        c = router_chunks(t, 7168, 256)
        assert 7168 % c == 0 and (2 * t + 2 * 256) * (7168 // c) <= ROUTER_SMEM
    assert router_chunks(256, 64, 8) == 4  # D / 8 would be under 16: no further split


def test_more_router_chunks_keep_the_routing():
    """8 chunks instead of 4 (what 256 tokens take): the logits' partials summed in another order, the same
    routing and h_new / x, the weights within fp32 rounding of the reference."""
    T, D, E, k, S = 32, 256, 64, 6, 2
    parts, h, norm_w, gate, _ = _case(T, D, E, 2, jnp.float32, False, seed=7)
    kw = dict(eps=1e-6, k=k, num_shared=S, block_m=16)
    got = residual_route(parts, h, norm_w, gate, 1, chunks=8, interpret=True, **kw)
    want = residual_route_reference(parts, h, norm_w, gate, 1, **kw)
    for name, g, w in zip(NAMES, got, want):
        if name in ("h_new", "x", "weights"):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=2e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


def test_partials_not_a_power_of_two_are_summed_row_by_row():
    """Three partials (summed one row at a time, not loaded as one [S, D] block): the reference's values."""
    T, D, E = 16, 128, 16
    parts, h, norm_w, gate, _ = _case(T, D, E, 2, jnp.float32, False, seed=9)
    kw = dict(eps=1e-6, k=4, num_shared=1, block_m=16)
    got = residual_route(parts[:3], h, norm_w, gate, 1, interpret=True, **kw)
    want = residual_route_reference(parts[:3], h, norm_w, gate, 1, **kw)
    for name, g, w in zip(NAMES, got, want):
        if name in ("h_new", "x", "weights"):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=2e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
