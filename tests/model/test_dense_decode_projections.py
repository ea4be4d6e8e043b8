"""The dense family's decode-size steps with RunnerConfig.decode_projection_kernel: q / kv / o projections and the
MLP read in place from the layer-stacked weights by kernels/decode_matmul.py (interpret mode) instead of XLA's
GEMMs on sliced weights. Paged prefill and decode steps give HF transformers' logits (fp32; Qwen2: q/k/v biases,
tied embeddings) at power-of-two widths the kernel tiles; which steps take the kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hf_models import build_dense_hf_model, hf_logits, save_hf_model
from paged_steps import PAGE, step
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.dense import STACKABLE, decode_projections
from deepinfer_jax.models.registry import family_of, init_kv_cache
from deepinfer_jax.weights.hf_loader import load_hf_checkpoint


def test_decode_projections_read_in_place_give_hf_logits(tmp_path):
    model = build_dense_hf_model("qwen2_tied", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16)
    path = save_hf_model(model, str(tmp_path))
    cfg, params = load_hf_checkpoint(path, ModelConfig.from_model_dir(path), jnp.float32, progress=False)
    seg = params["segments"][0]
    assert set(decode_projections(seg, 16, "pallas_interpret", False, True)) == {(g, n) for g, n, _ in STACKABLE}
    for off in [(seg, 128, "pallas_interpret", False, True),  # a prefill-size step: XLA's GEMMs
                (seg, 16, "reference", False, True), (seg, 16, "pallas_interpret", True, True),  # sharded
                (seg, 16, "pallas_interpret", False, False)]:
        assert decode_projections(*off) == {}

    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, (3, 30))
    ref = hf_logits(model, ids)
    pages = [[5, 2, 9, 14], [3, 11, 7, 1], [6, 4, 13, 12]]
    cache = init_kv_cache(cfg, 16, PAGE, jnp.float32)
    kw = dict(attn_impl="pallas_interpret", decode_projection_kernel=True)
    fwd = jax.jit(lambda p, c, m: family_of(cfg).forward_paged(p, cfg, c, m, **kw))
    jaxpr = str(jax.make_jaxpr(fwd)(params, cache, _meta(ids, pages, [(0, 11), (0, 1), (0, 9)], 24)))
    assert jaxpr.count("name=decode_matmul") == 5  # kernels/decode_matmul.py in the scanned layer, each projection
    logits, cache = step(params, cfg, cache, ids, pages, [(0, 11), (0, 1), (0, 9)], pad_to=24, fwd=fwd)
    np.testing.assert_allclose(np.asarray(logits), ref[[0, 1, 2], [10, 0, 8]], atol=1e-4)
    logits, cache = step(params, cfg, cache, ids, pages, [(11, 12), (1, 1), (9, 17)], fwd=fwd)
    np.testing.assert_allclose(np.asarray(logits), ref[[0, 1, 2], [22, 1, 25]], atol=1e-4)
    for t in range(2):
        logits, cache = step(params, cfg, cache, ids, pages, [(23 + t, 1), (2 + t, 1), (26 + t, 1)], pad_to=4,
                             fwd=fwd)
        np.testing.assert_allclose(np.asarray(logits), ref[[0, 1, 2], [23 + t, 2 + t, 26 + t]], atol=1e-4)
    assert np.abs(ref).max() > 0.5  # logits far from zero: the test could fail


def _meta(ids, pages, chunks, pad_to):
    """The StepMetadata `step` builds for these chunks (to trace the forward once)."""
    return step(None, None, None, ids, pages, chunks, pad_to=pad_to, fwd=lambda p, c, m: m)
