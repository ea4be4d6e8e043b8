"""kernels/moe_gmm_mgpu.py in Mosaic GPU's interpreter: the warp-specialized grouped GEMM against its pure-JAX
reference (skipped blocks, several tiles and loop orders, a layer of stacked weights through the flattened expert
ids), on moe_gmm.align_tokens' rows against each token copy's own product, and its lowering for the GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels.moe_gmm import align_tokens
from deepinfer_jax.kernels.moe_gmm_mgpu import grouped_matmul, grouped_matmul_reference


def _close(got, want, valid_rows):
    """bf16 outputs of one fp32-accumulated product: equal within two bf16 ulps of the largest value."""
    got, want = np.asarray(got, np.float32)[valid_rows], np.asarray(want, np.float32)[valid_rows]
    np.testing.assert_allclose(got, want, atol=2 * 2.0 ** -7 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("tile_m,tile_n,steps,minor,width", [(64, 64, 2, "m", 2), (128, 64, 3, "n", 1),
                                                             (64, 128, 2, "m", 8)])
def test_matches_reference(tile_m, tile_n, steps, minor, width):
    G, K, N = 4, 192, 256
    be = jnp.array([1, -1, 0, 3, 1, -1], jnp.int32)  # two skipped blocks, expert 1 in two
    R = be.shape[0] * tile_m
    kx, kw = jax.random.split(jax.random.key(tile_m + tile_n + steps))
    x = jax.random.normal(kx, (R, K), jnp.bfloat16)
    w = jax.random.normal(kw, (G, K, N), jnp.bfloat16)
    got = grouped_matmul(x, w, be, tile_m=tile_m, tile_n=tile_n, tile_k=64, steps=steps, minor=minor, width=width,
                         interpret=True)
    assert got.shape == (R, N) and got.dtype == jnp.bfloat16
    want = grouped_matmul_reference(x, w, be, tile_m)
    _close(got, want, np.repeat(np.asarray(be) >= 0, tile_m))
    # the reference itself: block 3 is x's rows 3 * tile_m .. times expert 3
    rows = slice(3 * tile_m, 4 * tile_m)
    _close(want[rows], (x[rows].astype(jnp.float32) @ w[3].astype(jnp.float32)).astype(jnp.bfloat16),
           np.ones(tile_m, bool))


def test_aligned_token_copies_of_one_layer():
    """A layer's experts from stacked weights [L, E, K, N] as [L * E, K, N] with the ids offset by layer * E, over
    align_tokens' rows: every token copy's row is that token's x times its expert's matrix of that layer."""
    L, E, K, N, T, k, tm = 2, 4, 128, 128, 40, 3, 64
    kx, kw, ki = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(kx, (T, K), jnp.bfloat16)
    w = jax.random.normal(kw, (L, E, K, N), jnp.bfloat16)
    idx = jax.random.randint(ki, (T, k), 0, E).astype(jnp.int32)
    row_copy, block_expert, row_of = align_tokens(idx, E, tm)
    layer = 1
    xs = x[jnp.maximum(row_copy, 0) // k]                                   # [M_pad, K] the rows' tokens
    ids = jnp.where(block_expert >= 0, block_expert + layer * E, -1)
    y = grouped_matmul(xs, w.reshape(L * E, K, N), ids, tile_m=tm, tile_n=64, tile_k=64, steps=2, interpret=True)
    got = np.asarray(y, np.float32)[np.asarray(row_of)]                     # [T * k, N] in copy order
    want = jnp.einsum("tk,tjkn->tjn", x.astype(jnp.float32), w[layer][idx].astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST).reshape(T * k, N)
    _close(got, want.astype(jnp.bfloat16), np.ones(T * k, bool))


def test_lowers_for_the_gpu_at_the_prefill_shape():
    """Protocol A's prefill down GEMM (16,384 x top-6 copies aligned to 128-row blocks, 26 layers x 64 experts of
    [1,408, 2,048]): one Mosaic GPU custom call over 132 programs."""
    s = jax.ShapeDtypeStruct
    R = -(-(16384 * 6 + 64 * 127) // 128) * 128
    args = (s((R, 1408), jnp.bfloat16), s((26 * 64, 1408, 2048), jnp.bfloat16), s((R // 128,), jnp.int32))
    hlo = jax.jit(lambda x, w, b: grouped_matmul(x, w, b, num_programs=132)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert hlo.count("stablehlo.custom_call @mosaic_gpu") == 1
