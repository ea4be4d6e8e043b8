"""kernels/route_experts.py (interpret mode): the route launch and the experts' single launch as one grid, against
the pure-JAX reference, and bit for bit against the two launches it replaces (residual_route, then
moe_route.moe_fused_decode's single launch)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels.moe_route import decode_block_m, moe_fused_decode
from deepinfer_jax.kernels.residual_route import residual_route
from deepinfer_jax.kernels.route_experts import route_experts, route_experts_reference


def _case(T, D, E, I, S, dtype, bias, seed):
    rng = np.random.default_rng(seed)
    f = lambda *shape, scale=0.05: jnp.asarray(rng.standard_normal(shape) * scale, dtype)  # noqa: E731
    L = 3
    parts = jnp.asarray(rng.standard_normal((8, T, D)) * 0.3, jnp.float32)
    h, norm_w, gate = f(T, D, scale=1.0), jnp.asarray(rng.uniform(0.5, 1.5, (L, D)), dtype), f(L, D, E)
    experts = (f(L, E, D, 2, I), f(L, E, I, D))
    shared = (f(L, D, 2, S * I), f(L, S * I, D)) if S else (None, None)
    b = jnp.asarray(rng.random(E) * 0.1, jnp.float32) if bias else None
    return parts, h, norm_w, gate, experts, shared, b


CASES = [  # T, D, E, I, k, S, scoring, bias
    (32, 256, 64, 128, 6, 2, "softmax", False),  # V2-Lite's routing and shared experts at Protocol A's batch
    (16, 128, 16, 64, 4, 1, "sigmoid", True),  # noaux_tc's bias, normalised weights, one shared expert
    (16, 128, 16, 64, 4, 0, "softmax", False),  # no shared experts
]


@pytest.mark.parametrize("T, D, E, I, k, S, scoring, bias", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_equals_the_two_launches_and_the_reference(T, D, E, I, k, S, scoring, bias, dtype):
    parts, h, norm_w, gate, (wgu, wd), (sgu, sd), b = _case(T, D, E, I, S, dtype, bias, seed=T + E + S)
    kw = dict(eps=1e-6, k=k, scoring_func=scoring, norm_topk_prob=bias, routed_scaling_factor=2.5 if bias else 1.0)
    got = route_experts(parts, h, norm_w, gate, 1, wgu, wd, sgu, sd, b, interpret=True, **kw)
    h_new, x, *routed = residual_route(parts, h, norm_w, gate, 1, b, num_shared=S, block_m=decode_block_m(T, k, S),
                                       interpret=True, **kw)
    out, idx = moe_fused_decode(x, None, None, wgu, wd, 1, sgu, sd, k=k, single_launch=True, routed=tuple(routed),
                                interpret=True)
    for name, g, w in zip(("h_new", "x", "out", "idx"), got, (h_new, x, out, idx)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=name)
    want = route_experts_reference(parts, h, norm_w, gate, 1, wgu, wd, sgu, sd, b, **kw)
    tol = 2e-6 if dtype == jnp.float32 else 1e-2  # bf16: one rounding step of out (|out| < 1)
    for name, g, w in zip(("h_new", "x", "out"), got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol,
                                   err_msg=name)
    np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(want[3]))
    assert float(jnp.max(jnp.abs(got[2].astype(jnp.float32)))) > 0.01  # the experts contributed
    # Layer 1's weights, not another layer's.
    other = route_experts(parts, h, norm_w, gate, 2, wgu, wd, sgu, sd, b, interpret=True, **kw)
    assert not np.allclose(np.asarray(other[2], np.float32), np.asarray(got[2], np.float32))


def test_launch_order_and_warps_keep_the_output():
    """The shared down tiles launched after the routed gate_up tiles, and 8 warps: the same output bit for bit."""
    T, D, E, I, k, S = 16, 128, 16, 64, 4, 1
    parts, h, norm_w, gate, (wgu, wd), (sgu, sd), _ = _case(T, D, E, I, S, jnp.bfloat16, False, seed=9)
    base = route_experts(parts, h, norm_w, gate, 1, wgu, wd, sgu, sd, eps=1e-6, k=k, interpret=True)
    for kw in ({"shared_down_late": True}, {"num_warps": 8, "shared_down_late": True}):
        got = route_experts(parts, h, norm_w, gate, 1, wgu, wd, sgu, sd, eps=1e-6, k=k, interpret=True, **kw)
        for g, w in zip(got, base):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))



@pytest.mark.parametrize("shared_tiles", [(32, 32, 64), (16, 64, 128), (32, 16, 32)])
def test_shared_tiles_keep_the_output(shared_tiles):
    """The shared experts' tiles at their own row blocks and column widths (whole-T rows, narrow columns): the
    routing as before, bit for bit, and the output as the routed tiles' sizes give it and the reference's, within
    fp32 rounding (a dot's summation order may follow its tile's shape)."""
    T, D, E, I, k, S = 32, 256, 64, 128, 6, 2
    parts, h, norm_w, gate, (wgu, wd), (sgu, sd), _ = _case(T, D, E, I, S, jnp.float32, False, seed=11)
    kw = dict(eps=1e-6, k=k)
    base = route_experts(parts, h, norm_w, gate, 1, wgu, wd, sgu, sd, interpret=True, **kw)
    got = route_experts(parts, h, norm_w, gate, 1, wgu, wd, sgu, sd, shared_tiles=shared_tiles, interpret=True, **kw)
    for name, g, w in zip(("h_new", "x", "idx"), got[:2] + got[3:], base[:2] + base[3:]):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(base[2]), rtol=2e-6, atol=2e-6)
    want = route_experts_reference(parts, h, norm_w, gate, 1, wgu, wd, sgu, sd, **kw)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=2e-6, atol=2e-6)
    assert float(jnp.max(jnp.abs(got[2]))) > 0.01
