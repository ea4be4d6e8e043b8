"""The router's logits: 16-bit inputs multiply on the tensor-core path and still equal HF's fp32 linear."""

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.models.moe import router_logits


def test_bf16_router_logits_equal_the_fp32_linear():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 2048)), jnp.bfloat16)
    gate = jnp.asarray(rng.standard_normal((2048, 64)) * 0.02, jnp.bfloat16)
    got = router_logits({"gate": gate}, x)
    assert got.dtype == jnp.float32
    # HF: F.linear(x.float(), w.float()) — every product of two bf16 values is exact in fp32.
    want = np.asarray(x, np.float64) @ np.asarray(gate, np.float64)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.abs(want).max())
    # fp32 inputs keep the fp32 path, bit for bit the HIGHEST-precision einsum.
    x32, g32 = x.astype(jnp.float32), gate.astype(jnp.float32)
    ref = jnp.einsum("td,de->te", x32, g32, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_array_equal(np.asarray(router_logits({"gate": g32}, x32)), np.asarray(ref))
