"""DeepSeek-V3.2 (DeepSeek Sparse Attention): the pure-JAX forward and the paged steps equal HF transformers in
fp32 on a tiny random checkpoint whose prompts are longer than index_topk, so the indexer really drops keys."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_models import hf_logits
from deepinfer_jax.config import ConfigError, ModelConfig
from deepinfer_jax.models.deepseek import forward
from deepinfer_jax.weights.hf_loader import load_hf_checkpoint

CASE = "v32_sparse"


@pytest.fixture(scope="module")
def v32(hf_case):
    model, path = hf_case(CASE)
    cfg = ModelConfig.from_model_dir(path)
    cfg, params = load_hf_checkpoint(path, cfg, jnp.float32, progress=False)
    return model, path, cfg, params


def test_all_position_logits_match_hf(v32):
    model, _, cfg, params = v32
    assert cfg.has_indexer and cfg.index_topk < 47
    assert cfg.kv_cache_dim == cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 47))
    ref = hf_logits(model, ids)
    out = np.asarray(jax.jit(lambda p, t: forward(p, cfg, t))(params, jnp.asarray(ids, jnp.int32)))
    assert np.abs(out - ref).max() <= 1e-4
    # The selection matters: attending to every key (no indexer) gives other logits past index_topk tokens.
    dense_cfg = dataclasses.replace(cfg, index_topk=0)
    dense = np.asarray(jax.jit(lambda p, t: forward(p, dense_cfg, t))(params, jnp.asarray(ids, jnp.int32)))
    assert np.abs(dense[:, : cfg.index_topk] - ref[:, : cfg.index_topk]).max() <= 1e-4
    assert np.abs(dense - ref).max() > 0.1


def test_convert_round_trip(v32, tmp_path):
    """The converter carries the indexer's weights: the converted directory loads to the same params."""
    from deepinfer_jax.weights.convert import convert
    from deepinfer_jax.weights.loader import load_model

    _, path, cfg, params = v32
    dst = str(tmp_path / "conv")
    convert(path, dst, "float32", "none", progress=False)
    cfg_c, p_c = load_model(dst, jnp.float32, progress=False)
    assert cfg_c == cfg
    flat, tree = jax.tree_util.tree_flatten_with_path(p_c)
    assert any("indexer" in jax.tree_util.keystr(k) for k, _ in flat)
    assert tree == jax.tree_util.tree_structure(params)
    for a, b in zip(jax.tree_util.tree_leaves(p_c), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _v32_dict(**kw):
    d = dict(model_type="deepseek_v32", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
             num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
             v_head_dim=8, max_position_embeddings=64, index_n_heads=2, index_head_dim=8, index_topk=4)
    return {**d, **kw}


@pytest.mark.parametrize("kw, message", [
    (dict(index_topk=None), "index_topk"),
    (dict(index_n_heads=0), "index_n_heads"),
    (dict(q_lora_rank=None), "q_lora_rank"),
    (dict(index_head_dim=2), "index_head_dim"),
])
def test_bad_indexer_configs_are_refused(kw, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(_v32_dict(**kw))
    cfg = ModelConfig.from_hf_dict(_v32_dict())
    assert (cfg.topk_method, cfg.scoring_func, cfg.index_topk) == ("noaux_tc", "sigmoid", 4)


def test_paged_steps_through_the_kernels_equal_the_forward(v32):
    """Through the kernels (interpret mode), a chunked prefill of two sequences (chunks of 19 and 30 tokens, then
    the rest) and a decode step give the full forward's logits at each step's last tokens. Every step is padded
    to 48 tokens: one compiled step. (The reference path's steps: tests/engine/test_dsa_engine.py, against HF.)"""
    from paged_steps import step
    from deepinfer_jax.models.cache import init_kv_cache
    from deepinfer_jax.models.deepseek import forward_paged

    fn = jax.jit(forward_paged, static_argnums=1, static_argnames="attn_impl")

    _, _, cfg, params = v32
    ids = np.random.default_rng(5).integers(2, cfg.vocab_size, (2, 45))
    full = np.asarray(jax.jit(lambda p, t: forward(p, cfg, t))(params, jnp.asarray(ids, jnp.int32)))
    pages = [[3, 1, 6, 2, 9, 5], [4, 7, 8, 10, 11, 12]]
    cache = init_kv_cache(cfg, 13, 8, jnp.float32)
    for chunks in ([(0, 19), (0, 30)], [(19, 25), (30, 14)], [(44, 1), (44, 1)]):
        logits, cache = step(params, cfg, cache, ids, pages, chunks, pad_to=48, attn_impl="pallas_interpret", fn=fn)
        for s, (start, n) in enumerate(chunks):
            np.testing.assert_allclose(np.asarray(logits[s]), full[s, start + n - 1], atol=1e-4, rtol=0)


def test_paged_step_refuses_what_it_does_not_run(v32):
    from deepinfer_jax.models.cache import StepMetadata, init_kv_cache
    from deepinfer_jax.models.deepseek import forward_paged

    _, _, cfg, params = v32
    z = jnp.zeros((4,), jnp.int32)
    meta = StepMetadata(z, z, z, z, jnp.zeros((1, 2), jnp.int32), z[:1])
    cache = init_kv_cache(cfg, 3, 8, jnp.float32)
    with pytest.raises(ValueError, match="attn_impl 'triton'"):
        forward_paged(params, cfg, cache, meta, attn_impl="triton")


def test_dummy_fp8_release_draws_the_leaves_the_release_loads_as(v32, tmp_path):
    """load_format "dummy" on a V3.2 FP8 release config.json (weights/release_random.py): the tree that an FP8
    release of the same config loads as (every projection DeepSeek ships in e4m3 kept as an Fp8Weight at the odd
    block 8 x 12, the indexer's wq_b / wk dequantized by the loader), FP8 leaves finite at the float dummy's scale."""
    from hf_models import fp8_checkpoint
    from deepinfer_jax.models.quant import dequantize, is_fp8
    from deepinfer_jax.weights.loader import prepare_model
    from deepinfer_jax.weights.name_table import expected_tensors
    from deepinfer_jax.weights.release_random import Fp8Release, fp8_codes, pending_release_params, release_format

    _, path, cfg, _ = v32
    shipped = {r.hf_name for r in expected_tensors(cfg) if r.quantizable}  # DeepSeek's FP8 tensors
    assert "model.layers.0.self_attn.indexer.wk.weight" in shipped
    rel, _ = fp8_checkpoint(path, str(tmp_path / "rel"), (8, 12), lambda name, w: name in shipped)
    _, loaded = prepare_model(rel, jnp.float32, progress=False)
    quant = release_format(rel, cfg)
    assert quant == Fp8Release((8, 12)) and release_format(path, cfg) is None  # a float checkpoint: float draws
    dummy = pending_release_params(cfg, quant, jnp.float32, seed=3)

    def described(tree):
        return [(jax.tree_util.keystr(p), tuple(x.shape), jnp.dtype(x.dtype))
                for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]

    assert described(dummy.abstract) == described(loaded.abstract)
    params = dummy.result()
    kept = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_fp8)[0]
            if is_fp8(x)}
    assert len(kept) == 5 + 2 + 5 + 2 + 2 and not any("indexer" in k for k in kept)  # attn, mlp / experts, shared
    for name, w in kept.items():
        full = np.asarray(dequantize(w, jnp.float32))
        assert np.all(np.isfinite(full)) and 0.005 < np.abs(full).mean() and np.abs(full).max() < 0.1, name
    # A leaf above the draw's chunk is drawn a slice of its leading axes at a time: the same codes' law.
    big = np.asarray(jax.jit(lambda k: fp8_codes(k, (3, 5, 7, 11), chunk=60))(jax.random.key(0)), np.float32)
    assert big.shape == (3, 5, 7, 11) and np.abs(big).max() <= 1 and 0.4 < np.abs(big).mean() < 0.6
    assert len(np.unique(big[0, 0])) > 20 and not np.array_equal(big[0, 0], big[0, 1])
