"""The fused routing + alignment kernel (interpret mode) equals its pure-JAX reference, which equals the
model's router (`models.moe.route`) followed by `align_tokens`."""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels.moe_route import padded_rows, route_align, route_align_reference, supported

CASES = [  # T, E, k, S, block_m, scoring, norm, scale, bias
    (1, 64, 6, 2, 16, "softmax", False, 1.0, False),  # V2-Lite, one decode token
    (32, 64, 6, 2, 16, "softmax", False, 1.0, False),  # V2-Lite, Protocol A's batch
    (256, 64, 6, 2, 16, "softmax", False, 1.0, False),  # the largest decode bucket (2,048 copies)
    (16, 8, 2, 1, 4, "sigmoid", True, 2.446, True),  # Moonlight-like noaux_tc with one group
    (8, 16, 3, 0, 8, "softmax", True, 1.0, False),  # no shared experts
]


def _inputs(T, E, bias, seed=0):
    rng = np.random.default_rng(seed + T + E)
    logits = jnp.asarray(rng.standard_normal((T, E)) * 2.0, jnp.float32)
    return logits, (jnp.asarray(rng.random(E) * 0.1, jnp.float32) if bias else None)


@pytest.mark.parametrize("T, E, k, S, bm, scoring, norm, scale, bias", CASES)
def test_kernel_matches_reference(T, E, k, S, bm, scoring, norm, scale, bias):
    logits, b = _inputs(T, E, bias)
    kw = dict(k=k, num_shared=S, block_m=bm, scoring_func=scoring, norm_topk_prob=norm, routed_scaling_factor=scale)
    got = route_align(logits, b, interpret=True, **kw)
    want = route_align_reference(logits, b, **kw)
    names = ("weights", "idx", "row_copy", "block_expert", "row_of")
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=1e-7, err_msg=names[0])
    for name, g, w in list(zip(names, got, want))[1:]:
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
    M = padded_rows(T, k, S, E, bm)
    assert got[2].shape == (M,) and got[3].shape == (M // bm,) and got[4].shape == (T * (k + S),)


@pytest.mark.parametrize("bias", [None, jnp.zeros(8)])
def test_ties_pick_the_lowest_expert_like_top_k(bias):
    logits = jnp.zeros((4, 8), jnp.float32).at[:, 5].set(1.0)  # expert 5 first, then all tied
    got = route_align(logits, bias, k=3, num_shared=0, block_m=4, interpret=True)
    assert np.asarray(got[1]).tolist() == [[5, 0, 1]] * 4
    want = route_align_reference(logits, bias, k=3, num_shared=0, block_m=4)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_reference_is_the_models_router():
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.models.moe import route

    logits, b = _inputs(16, 8, True)
    cfg = dataclasses.replace(ModelConfig.from_json_file(
        os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models", "tiny-deepseek-v3.json")), n_routed_experts=8,
                              num_experts_per_tok=2, n_group=1, topk_group=1, topk_method="noaux_tc",
                              scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.446)
    # route() computes logits = x @ gate; an identity gate makes x the logits.
    p = {"gate": jnp.eye(8, dtype=jnp.float32), "e_score_correction_bias": b}
    w_m, idx_m = route(p, cfg, logits)
    w_r, idx_r, *_ = route_align_reference(logits, b, k=2, num_shared=1, block_m=4, scoring_func="sigmoid",
                                           norm_topk_prob=True, routed_scaling_factor=2.446)
    np.testing.assert_array_equal(np.asarray(idx_r[:, :2]), np.asarray(idx_m))
    np.testing.assert_allclose(np.asarray(w_r[:, :2]), np.asarray(w_m), rtol=1e-6)


def test_supported_sizes():
    assert supported(32, 64, 6, 2) and supported(256, 64, 6, 2)
    assert not supported(512, 64, 6, 2)  # 4,096 copies: prefill sizes keep the sort
    assert not supported(24, 64, 6, 2) and not supported(32, 48, 6, 2)  # not powers of two
    with pytest.raises(ValueError, match="powers of two"):
        route_align(jnp.zeros((3, 8)), jnp.zeros(8), k=2, num_shared=0, block_m=4, interpret=True)


@pytest.mark.parametrize("S", [0, 2])
def test_fused_decode_equals_router_plus_experts_reference(S):
    """moe_fused_decode (route_align, then the expert kernels gathering their rows from x) equals the
    reference routing followed by the reference experts and the shared MLP."""
    import jax

    from deepinfer_jax.kernels.moe_gmm import moe_experts_reference
    from deepinfer_jax.kernels.moe_route import moe_fused_decode

    T, E, k, D, I = 16, 8, 3, 64, 32
    rng = np.random.default_rng(S)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    wgu = jnp.asarray(rng.standard_normal((E, D, 2, I)) * 0.1, jnp.float32)
    wd = jnp.asarray(rng.standard_normal((E, I, D)) * 0.1, jnp.float32)
    logits, bias = _inputs(T, E, False)
    w, idx, *_ = route_align_reference(logits, bias, k=k, num_shared=0, block_m=16)
    want = moe_experts_reference(x, wgu, wd, w, idx)
    shared = ()
    if S:
        sgu = jnp.asarray(rng.standard_normal((D, 2, S * I)) * 0.1, jnp.float32)
        sd = jnp.asarray(rng.standard_normal((S * I, D)) * 0.1, jnp.float32)
        hp = jax.lax.Precision.HIGHEST
        gu = jnp.einsum("td,dgi->tgi", x, sgu, precision=hp)
        want = want + jnp.einsum("ti,id->td", jax.nn.silu(gu[:, 0]) * gu[:, 1], sd, precision=hp)
        shared = (sgu, sd)
    out, got_idx = moe_fused_decode(x, logits, bias, wgu, wd, None, *shared, k=k, interpret=True)
    np.testing.assert_array_equal(np.asarray(got_idx), np.asarray(idx))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, S, T", [(jnp.float32, 2, 32), (jnp.bfloat16, 0, 16), (jnp.bfloat16, 2, 64)])
def test_single_launch_equals_two_launches(dtype, S, T):
    """Both expert kernels in one launch (moe_gmm `single_launch`: gate_up tiles then down tiles, block-major,
    a row block's down tiles waiting on its counter) give the two launches' output bit for bit, with stacked
    weights read at a layer index, shared experts and padded row blocks."""
    from deepinfer_jax.kernels.moe_route import moe_fused_decode

    L, E, k, D, I = 2, 16, 4, 128, 64
    rng = np.random.default_rng(T + S)
    u = lambda *shape: jnp.asarray(rng.uniform(-0.1, 0.1, shape), dtype)  # noqa: E731
    x = jnp.asarray(rng.standard_normal((T, D)), dtype)
    wgu, wd = u(L, E, D, 2, I), u(L, E, I, D)
    shared = (u(L, D, 2, S * I), u(L, S * I, D)) if S else ()
    logits = jnp.asarray(rng.standard_normal((T, E)) * 2.0, jnp.float32)
    run = lambda single: moe_fused_decode(x, logits, None, wgu, wd, jnp.int32(1), *shared, k=k,  # noqa: E731
                                          single_launch=single, interpret=True)
    (two, idx2), (one, idx1) = run(False), run(True)
    np.testing.assert_array_equal(np.asarray(idx1), np.asarray(idx2))
    np.testing.assert_array_equal(np.asarray(one.astype(jnp.float32)), np.asarray(two.astype(jnp.float32)))
    assert float(jnp.abs(one.astype(jnp.float32)).max()) > 0
