"""Building blocks against DeepSeek's published numbers and HF's functions."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.layers import apply_rope, rms_norm, rope_attention_factor, rope_inv_freq

PRESETS = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models")


def preset(name):
    return ModelConfig.from_json_file(os.path.join(PRESETS, f"{name}.json"))


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite"])
def test_yarn_inv_freq_blend(name):
    """low = 10, high = 23 for V3 and V2-Lite: below keeps base frequency, above is divided by 40."""
    c = preset(name)
    inv = rope_inv_freq(c)
    base = 1.0 / (10000.0 ** (np.arange(0, 64, 2) / 64))
    assert inv.shape == (32,)
    np.testing.assert_allclose(inv[:10], base[:10], rtol=1e-6)
    np.testing.assert_allclose(inv[23:], base[23:] / 40, rtol=1e-6)
    ramp = (np.arange(10, 23) - 10) / 13
    np.testing.assert_allclose(inv[10:23], base[10:23] / 40 * ramp + base[10:23] * (1 - ramp), rtol=1e-6)
    assert rope_attention_factor(c) == 1.0


def test_yarn_matches_hf():
    import torch  # noqa: F401
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    c = preset("deepseek-v3")
    hf = DeepseekV3Config(rope_parameters={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                           "rope_theta": 10000.0})
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, None)
    np.testing.assert_allclose(rope_inv_freq(c), inv.numpy(), rtol=1e-6)
    assert factor == pytest.approx(rope_attention_factor(c))


def test_pairwise_rope_rotates_adjacent_pairs():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 2, 8)), jnp.float32)  # [T, H, d]
    theta = np.array([0.3, 1.1, -0.7])[:, None] * np.array([1.0, 0.5, 0.25, 0.125])  # [T, d/2]
    y = np.asarray(apply_rope(x, jnp.cos(theta), jnp.sin(theta)))
    xc = np.asarray(x)[..., 0::2] + 1j * np.asarray(x)[..., 1::2]
    ref = xc * np.exp(1j * theta)[:, None, :]
    np.testing.assert_allclose(y[..., 0::2], ref.real, atol=1e-6)
    np.testing.assert_allclose(y[..., 1::2], ref.imag, atol=1e-6)


def test_rms_norm_hf_arithmetic_in_bf16():
    """Normalise in fp32, cast to bf16, then multiply by the bf16 weight (HF's order)."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 16)) * 3, jnp.bfloat16)
    w = jnp.asarray(np.random.default_rng(2).standard_normal(16), jnp.bfloat16)
    y = rms_norm(x, w, 1e-6)
    xf = np.asarray(x, np.float32)
    normed = (xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + 1e-6)).astype(jnp.bfloat16)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y), np.asarray(w * jnp.asarray(normed)))
