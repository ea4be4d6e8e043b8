"""An FP8 (e4m3, scale 1.0) latent KV cache: stored as e4m3, dequantized on read by the reference attention, logits
within a measured bound of the fp32 cache's; and through the engine end to end at half the bytes per token."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.cache import init_kv_cache
from deepinfer_jax.models.deepseek import forward_paged
from deepinfer_jax.weights.hf_loader import load_hf_checkpoint

from paged_steps import PAGE, step as _step

# Measured on the v2 case (5 steps, 15 logit rows): the fp8 cache's largest |logit difference| from the fp32 cache's
# run is 8.9% of the largest |logit|, the mean 4.7% of the mean |logit| (a bf16 cache: 0.9% and 0.4%; e4m3 keeps 3
# mantissa bits, bf16 7). On the grouped-routing v3 case one flipped expert choice takes the largest to 46%.
MAX_BOUND, MEAN_BOUND = 0.15, 0.08


def _run(params, cfg, dtype):
    fwd = jax.jit(lambda p, c, m: forward_paged(p, cfg, c, m, attn_impl="reference"))
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (3, 40))
    pages = [[5, 2, 9, 14, 20], [3, 11, 7, 1, 18], [6, 4, 13, 17, 8]]
    cache = init_kv_cache(cfg, 24, PAGE, dtype)
    logits, cache = _step(params, cfg, cache, ids, pages, [(0, 29), (0, 2), (0, 29)], pad_to=64, fwd=fwd)
    out = [logits]
    for t in range(4):  # decode steps read every earlier token from the cache
        logits, cache = _step(params, cfg, cache, ids, pages, [(29 + t, 1), (2 + t, 1), (29 + t, 1)], pad_to=64,
                              fwd=fwd)  # one step shape: one compile per cache dtype
        out.append(logits)
    return np.stack([np.asarray(x) for x in out]), cache


def test_fp8_cache_logits_within_bound(hf_case):
    _, path = hf_case("v2_greedy_yarn")
    cfg, params = load_hf_checkpoint(path, ModelConfig.from_model_dir(path), jnp.float32, progress=False)
    ref, _ = _run(params, cfg, jnp.float32)
    got, cache = _run(params, cfg, jnp.float8_e4m3fn)
    assert cache.dtype == jnp.float8_e4m3fn and np.isfinite(got).all()
    diff = np.abs(got - ref)
    assert 0 < diff.max() / np.abs(ref).max() <= MAX_BOUND
    assert diff.mean() / np.abs(ref).mean() <= MEAN_BOUND


def test_engine_with_fp8_cache(hf_case):
    """LLM(kv_cache_dtype="fp8") runs end to end on an e4m3 cache of half the bytes per token; attn_impl stands where
    the model's Pallas attention kernels read e4m3 (DeepSeek's MLA), elsewhere an explicit Pallas attention is
    refused."""
    from deepinfer_jax import LLM, SamplingParams
    from deepinfer_jax.engine.llm import kv_cache_attn_impl
    from deepinfer_jax.models.cache import kv_cache_bytes_per_page

    _, path = hf_case("v2_greedy_yarn")
    kw = dict(dtype="bfloat16", skip_tokenizer_init=True, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=64, page_size=8, progress=False, token_buckets=(4, 64))
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' runs with attn_impl 'reference' only"):
        kv_cache_attn_impl("fp8", "pallas", kernels_read_fp8=False)  # the sparse (V3.2) and GQA kernels
    assert kv_cache_attn_impl("fp8", "auto", kernels_read_fp8=False) == "reference"
    assert kv_cache_attn_impl("fp8", "pallas", kernels_read_fp8=True) == "pallas"  # DeepSeek's MLA kernels
    llm = LLM(path, kv_cache_dtype="fp8", **kw)
    runner, cfg = llm.engine.runner, llm.model_config
    assert runner.kv_cache.dtype == jnp.float8_e4m3fn
    per_page = kv_cache_bytes_per_page(cfg, 8, jnp.float8_e4m3fn)
    assert 2 * per_page == kv_cache_bytes_per_page(cfg, 8, jnp.bfloat16)
    assert runner.kv_cache.nbytes == runner.num_pages * per_page
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9] * 4}, {"prompt_token_ids": [3, 4]}],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]


def test_pallas_attention_on_an_fp8_cache_equals_the_reference(hf_case):
    """attn_impl="pallas_interpret" on an e4m3 cache: a padded prefill step, a chunked step over cached prefixes
    and an unpadded decode step (the decode kernel), each giving the reference path's logits and writing the same
    e4m3 cache, bit for bit (page 0, the null page padding writes into, aside)."""
    _, path = hf_case("v2_greedy_yarn")
    cfg, params = load_hf_checkpoint(path, ModelConfig.from_model_dir(path), jnp.float32, progress=False)
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, (3, 40))
    pages = [[5, 2, 9, 14, 20], [3, 11, 7, 1, 18], [6, 4, 13, 17, 8]]
    caches = {impl: init_kv_cache(cfg, 24, PAGE, jnp.float8_e4m3fn) for impl in ("reference", "pallas_interpret")}
    for chunks, pad_to in [([(0, 17), (0, 1), (0, 9)], 32), ([(17, 12), (1, 1), (9, 20)], None),
                           ([(29, 1), (2, 1), (29, 1)], None)]:
        out = {}
        for impl in caches:
            out[impl], caches[impl] = _step(params, cfg, caches[impl], ids, pages, chunks, pad_to, attn_impl=impl)
        np.testing.assert_allclose(np.asarray(out["pallas_interpret"]), np.asarray(out["reference"]), atol=2e-5)
        np.testing.assert_array_equal(np.asarray(caches["pallas_interpret"], np.float32)[:, 1:],
                                      np.asarray(caches["reference"], np.float32)[:, 1:])
