"""The dense family through the converter: fp32 round trip equal to the HF load leaf for leaf, and INT8 / INT4
conversions (q, kv, o projections and the MLP quantized; norms, biases, embeddings not) whose forward stays
close to the float one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.models.dense import forward
from deepinfer_jax.models.quant import is_quantized
from deepinfer_jax.weights.convert import convert
from deepinfer_jax.weights.loader import load_model


@pytest.fixture(scope="module")
def float_model(hf_case):
    _, src = hf_case("qwen2_tied")
    cfg, params = load_model(src, jnp.float32, progress=False)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 19)), jnp.int32)
    return src, cfg, params, ids, np.asarray(forward(params, cfg, ids))


def test_round_trip_fp32(float_model, tmp_path):
    src, cfg, params, ids, ref = float_model
    dst = str(tmp_path / "conv")
    convert(src, dst, "float32", "none", progress=False)
    cfg_c, p_c = load_model(dst, jnp.float32, progress=False)
    assert cfg_c == cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), p_c, params)


@pytest.mark.parametrize("method, tol", [("int8", 0.06), ("int4", 0.4)])
def test_quantized(float_model, tmp_path, method, tol):
    src, cfg, _, ids, ref = float_model
    dst = str(tmp_path / method)
    convert(src, dst, "float32", method, group_size=12, progress=False)
    cfg_q, p = load_model(dst, jnp.float32, progress=False)
    attn = p["segments"][0]["attn"]
    assert all(is_quantized(attn[k]) for k in ("q_proj", "kv_proj", "o_proj"))
    assert is_quantized(p["segments"][0]["mlp"]["down"]) and not is_quantized(attn["kv_bias"])
    assert not is_quantized(p["embed"])
    out = np.asarray(forward(p, cfg_q, ids))
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert 0 < err < tol
