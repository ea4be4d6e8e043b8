"""The block-aligned MoE grouped GEMM kernels (interpret mode) equal the pure-JAX reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels import moe_gmm
from deepinfer_jax.kernels.moe_gmm import align_tokens, moe_experts, moe_experts_reference


def _case(seed, T, D=64, I=32, E=8, k=3, skew=False, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, D)), dtype)
    wgu = jnp.asarray(rng.standard_normal((E, D, 2, I)) * 0.1, dtype)
    wd = jnp.asarray(rng.standard_normal((E, I, D)) * 0.1, dtype)
    if skew:  # most tokens pick experts 0..2: groups larger than one block
        idx = np.stack([rng.choice(3 if t % 4 else E, k, replace=False) for t in range(T)])
    else:
        idx = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    w = jnp.asarray(rng.random((T, k)), jnp.float32)
    return x, wgu, wd, w, jnp.asarray(idx, jnp.int32)


@pytest.mark.parametrize("method", ["compare", "sort"])
def test_align_tokens_layout(method, monkeypatch):
    if method == "sort":
        monkeypatch.setattr(moe_gmm, "COMPARE_ALIGN_MAX_COPIES", 0)
    idx = jnp.asarray([[2, 0], [2, 1], [0, 2]], jnp.int32)  # copies 0..5
    row_copy, block_expert, row_of = align_tokens(idx, num_experts=4, block_m=2)
    rc = np.asarray(row_copy)
    # expert 0: copies 1, 4; expert 1: copy 3 (+pad); expert 2: copies 0, 2, 5 (+pad); expert 3: none
    assert rc[:8].tolist() == [1, 4, 3, -1, 0, 2, 5, -1]
    assert (rc[8:] == -1).all()
    assert np.asarray(block_expert)[:4].tolist() == [0, 1, 2, 2] and (np.asarray(block_expert)[4:] == -1).all()
    assert np.asarray(row_of).tolist() == [4, 0, 5, 2, 1, 6]


@pytest.mark.parametrize("T, k, E, bm", [(1, 6, 64, 16), (32, 6, 64, 16), (57, 3, 8, 4), (300, 8, 16, 16)])
def test_compare_and_sort_alignments_agree(T, k, E, bm, monkeypatch):
    """The decode-size compare-and-count alignment equals the argsort one, skipped copies included."""
    rng = np.random.default_rng(T)
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    idx = jnp.asarray(np.where(rng.random(idx.shape) < 0.2, -1, idx), jnp.int32)
    got = align_tokens(idx, E, bm)
    monkeypatch.setattr(moe_gmm, "COMPARE_ALIGN_MAX_COPIES", 0)
    want = align_tokens(idx, E, bm)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    row_copy, _, row_of = (np.asarray(a) for a in got)
    valid = np.flatnonzero(np.asarray(idx).ravel() >= 0)
    assert (row_copy[row_of[valid]] == valid).all()


@pytest.mark.parametrize("T, skew", [(1, False), (5, False), (40, True), (33, False)])
def test_kernel_matches_reference(T, skew):
    x, wgu, wd, w, idx = _case(T, T, skew=skew)
    ref = moe_experts_reference(x, wgu, wd, w, idx)
    out = moe_experts(x, wgu, wd, w, idx, block_m=16, block_n=16, block_k=32, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cols_first, gather", [(True, False), (False, True), (True, True)])
def test_launch_order_and_in_kernel_gather_keep_the_result(cols_first, gather):
    """Column tiles launched first (prefill sizes) and rows gathered inside the gate_up kernel give the
    reference's result, skewed groups of several blocks included."""
    x, wgu, wd, w, idx = _case(3, 40, skew=True)
    ref = moe_experts_reference(x, wgu, wd, w, idx)
    out = moe_experts(x, wgu, wd, w, idx, block_m=16, block_n=16, block_k=32, cols_first=cols_first,
                      gather_in_kernel=gather, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
    assert moe_gmm.cols_first_for(2048) and not moe_gmm.cols_first_for(2047)
    assert moe_gmm.gather_in_kernel_for(98304) and not moe_gmm.gather_in_kernel_for(8192)


def test_down_kernel_takes_its_own_tiles():
    """The down kernel's own tiles (`down_tiles`: a wider column tile, a shorter K step) keep the reference's
    result, and the default keeps the gate_up kernel's tiles where those were given."""
    x, wgu, wd, w, idx = _case(4, 40, skew=True)
    ref = moe_experts_reference(x, wgu, wd, w, idx)
    rc, be, ro = align_tokens(idx, 8, 16)
    layer = jnp.zeros((1,), jnp.int32)
    for down in [(64, 16, 4, 2), None]:
        out = moe_gmm.moe_experts_aligned(x, wgu[None], wd[None], w, rc, be, ro, layer, block_m=16, block_n=16,
                                          block_k=32, cols_first=True, down_tiles=down, interpret=True)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
    assert moe_gmm.down_tile_config(256) == moe_gmm.tile_config(256)[1:]
    assert moe_gmm.down_tile_config(98304) == (256, 64, 8, 3)


def test_kernel_bf16():
    x, wgu, wd, w, idx = _case(7, 24, dtype=jnp.bfloat16)
    ref = moe_experts_reference(x, wgu, wd, w, idx).astype(jnp.float32)
    out = moe_experts(x, wgu, wd, w, idx, block_m=16, block_n=32, block_k=32, interpret=True)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), np.asarray(ref), atol=2e-2, rtol=2e-2)


def test_skipped_copies_cost_nothing_and_add_nothing():
    """Ids outside [0, E) (copies another device's experts handle) get no rows and no output."""
    x, wgu, wd, w, idx = _case(3, 20)
    skip = np.random.default_rng(1).random(idx.shape) < 0.4
    idx_s = jnp.where(jnp.asarray(skip), -1, idx)
    w_s = jnp.where(jnp.asarray(skip), 0.0, w)
    ref = moe_experts_reference(x, wgu, wd, w_s, jnp.where(jnp.asarray(skip), 0, idx))
    out = moe_experts(x, wgu, wd, w_s, idx_s, block_m=16, block_n=16, block_k=32, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
    row_copy, block_expert, _ = align_tokens(idx_s, num_experts=8, block_m=16)
    placed = set(np.asarray(row_copy)[np.asarray(row_copy) >= 0].tolist())
    assert placed == set(np.flatnonzero(~skip.ravel()).tolist())
    assert (np.asarray(block_expert) >= 0).sum() <= -(-(~skip).sum() // 16) + 8


def _shared_mlp(x, sgu, sd):
    """The shared experts as the model runs them without the kernels: one SwiGLU MLP (fp32)."""
    hp = jax.lax.Precision.HIGHEST
    gu = jnp.einsum("td,dgi->tgi", x, sgu, precision=hp)
    return jnp.einsum("ti,id->td", jax.nn.silu(gu[:, 0]) * gu[:, 1], sd, precision=hp)


@pytest.mark.parametrize("T, S", [(1, 1), (9, 2), (40, 2), (32, 2), (64, 1), (128, 2)])
def test_shared_experts_join_the_kernels(T, S):
    """Shared MLP of width S*I as S more experts with weight 1: routed + shared, in fp32; a shared
    expert's group of T rows spans T / 16 row blocks."""
    x, wgu, wd, w, idx = _case(10 + T, T)
    rng = np.random.default_rng(T)
    D, I = x.shape[1], wgu.shape[-1]
    sgu = jnp.asarray(rng.standard_normal((D, 2, S * I)) * 0.1, jnp.float32)
    sd = jnp.asarray(rng.standard_normal((S * I, D)) * 0.1, jnp.float32)
    want = moe_experts_reference(x, wgu, wd, w, idx) + _shared_mlp(x, sgu, sd)
    got = moe_experts(x, wgu, wd, w, idx, shared_gate_up=sgu, shared_down=sd, block_m=16, block_n=16, block_k=32,
                      interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    # Stacked over layers and read in place, as the model passes them.
    stack = lambda a: jnp.stack([a * 0.5, a])  # noqa: E731
    got1 = moe_experts(x, stack(wgu), stack(wd), w, idx, jnp.int32(1), shared_gate_up=stack(sgu),
                       shared_down=stack(sd), block_m=16, block_n=16, block_k=32, interpret=True)
    np.testing.assert_allclose(np.asarray(got1), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_routed_ids_past_the_experts_are_not_read_as_shared():
    x, wgu, wd, w, idx = _case(5, 12)
    E, D, I = wgu.shape[0], x.shape[1], wgu.shape[-1]
    sgu = jnp.ones((D, 2, I), jnp.float32) * 0.01
    sd = jnp.ones((I, D), jnp.float32) * 0.01
    bad = idx.at[:, 0].set(E)  # id E is the first shared expert inside the kernel, but not a routed id
    want = moe_experts_reference(x, wgu, wd, w.at[:, 0].set(0.0), idx) + _shared_mlp(x, sgu, sd)
    got = moe_experts(x, wgu, wd, w, bad, shared_gate_up=sgu, shared_down=sd, block_m=16, block_n=16, block_k=32,
                      interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
