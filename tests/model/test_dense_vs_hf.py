"""The dense family (models/dense.py: Llama, Qwen2, Qwen3, Mistral) against HF transformers in fp32: the pure
forward's logits at every position, and paged steps (chunked prefill, decode, padding) against that forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_models import DENSE_CASES, hf_logits
from paged_steps import PAGE, step
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.registry import init_kv_cache
from deepinfer_jax.models.dense import forward
from deepinfer_jax.weights.hf_loader import load_hf_checkpoint


def _load(path):
    return load_hf_checkpoint(path, ModelConfig.from_model_dir(path), jnp.float32, progress=False)


@pytest.fixture(params=sorted(DENSE_CASES))
def dense_case(request):
    return request.param


def test_all_position_logits_match_hf(hf_case, dense_case):
    model, path = hf_case(dense_case)
    cfg, params = _load(path)
    assert cfg.family == "dense" and model.model.layers[0].self_attn.scaling == pytest.approx(cfg.head_dim ** -0.5)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 37))
    ref = hf_logits(model, ids)
    out = np.asarray(jax.jit(lambda p, t: forward(p, cfg, t))(params, jnp.asarray(ids, jnp.int32)))
    assert out.shape == ref.shape
    assert np.abs(out - ref).max() <= 1e-4
    assert np.abs(ref).max() > 0.5  # the test could fail: logits far from zero


@pytest.mark.parametrize("attn_impl", ["reference", "pallas_interpret"])
def test_prefill_chunks_then_decode_equal_full_forward(hf_case, attn_impl):
    """The paged steps share the forward's projections; what differs is the attention over pages, here with
    Mistral's sliding window (7 keys) across page boundaries, by the reference and by the Pallas kernels
    (kernels/gqa_prefill.py for the prefill-size steps, kernels/gqa_attention.py for the decode steps). Every
    family's paged steps through the engine against HF: tests/engine/test_dense_llm.py."""
    _, path = hf_case("mistral_window")
    cfg, params = _load(path)
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (3, 30))
    full = np.asarray(forward(params, cfg, jnp.asarray(ids, jnp.int32)))
    pages = [[5, 2, 9, 14], [3, 11, 7, 1], [6, 4, 13, 12]]  # non-contiguous; page 0 never used
    cache = init_kv_cache(cfg, 16, PAGE, jnp.float32)
    logits, cache = step(params, cfg, cache, ids, pages, [(0, 11), (0, 1), (0, 9)], pad_to=24,
                         attn_impl=attn_impl)
    np.testing.assert_allclose(np.asarray(logits), full[[0, 1, 2], [10, 0, 8]], atol=2e-5)
    logits, cache = step(params, cfg, cache, ids, pages, [(11, 12), (1, 1), (9, 17)], attn_impl=attn_impl)
    np.testing.assert_allclose(np.asarray(logits), full[[0, 1, 2], [22, 1, 25]], atol=2e-5)
    for t in range(2):
        logits, cache = step(params, cfg, cache, ids, pages, [(23 + t, 1), (2 + t, 1), (26 + t, 1)], pad_to=4,
                             attn_impl=attn_impl)
        np.testing.assert_allclose(np.asarray(logits), full[[0, 1, 2], [23 + t, 2 + t, 26 + t]], atol=2e-5)
