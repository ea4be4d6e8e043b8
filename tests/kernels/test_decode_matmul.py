"""The decode-projection kernel (interpret mode) equals its pure-JAX reference: one layer of a stacked
weight, read in place, for the tilings `plan` picks (split K, uneven K steps, rows padded to 16)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels.decode_matmul import decode_matmul, decode_matmul_reference, plan, supported


@pytest.mark.parametrize("T, K, N, dtype", [
    (32, 512, 256, jnp.float32),  # split K over 4 programs per column tile
    (5, 192, 576, jnp.float32),  # rows padded to 16; K = 3 steps of 64; 576 = 9 column tiles
    (16, 384, 128, jnp.bfloat16),  # bf16 operands, fp32 accumulation
    (64, 128, 64, jnp.float32),  # the largest step the model sends; one K step
])
def test_kernel_matches_reference(T, K, N, dtype):
    key = jax.random.key(T + K + N)
    x = jax.random.normal(key, (T, K), dtype)
    w = (jax.random.normal(jax.random.fold_in(key, 1), (3, K, N), jnp.float32) * 0.05).astype(dtype)
    for layer in (0, 2):
        got = decode_matmul(x, w, layer, interpret=True)
        want = decode_matmul_reference(x, w, layer)
        assert got.shape == (T, N) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # Another layer's weights give another result: the layer index is honoured, not layer 0 read twice.
    assert not np.allclose(np.asarray(decode_matmul(x, w, 1, interpret=True)), np.asarray(want), atol=1e-3)


def test_plan_fills_the_gpu_and_divides_the_weight():
    for K, N in [(2048, 2048), (2048, 3072), (2048, 576), (10944, 2048), (2048, 21888), (1536, 3072)]:
        block_n, block_k, split_k, *_ = plan(K, N)
        assert N % block_n == 0 and K % (block_k * split_k) == 0
        assert (N // block_n) * split_k >= 128 or split_k == K // block_k
    assert plan(2048, 2048)[:3] == (128, 64, 8)  # o_proj of V2-Lite: 16 column tiles x 8 K chunks
    assert plan(10944, 2048)[:3] == (128, 64, 9)  # V2-Lite's dense MLP down: 171 K steps split 9 ways
    assert plan(100, 2048) is None  # no power-of-two K tile of at least 16
    assert plan(2048, 40) is None  # nor N tile
    assert supported(64, 2048, 2048) and not supported(65, 2048, 2048)
