"""kernels/moe_gmm_mgpu.py in Mosaic GPU's interpreter: the warp-specialized grouped GEMM and its SwiGLU (gate_up)
form against their pure-JAX references (skipped blocks, several tiles and loop orders, a layer of stacked weights
through the flattened expert ids), on moe_gmm.align_tokens' rows against each token copy's own product, and their
lowering for the GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels.moe_gmm import align_tokens
from deepinfer_jax.kernels.moe_gmm_mgpu import (grouped_matmul, grouped_matmul_reference, grouped_swiglu,
                                                grouped_swiglu_reference)


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


@pytest.mark.parametrize("tile_m,tile_n,steps", [(128, 64, 2), (256, 128, 3)])
def test_swiglu_form_matches_reference(tile_m, tile_n, steps):
    """h = silu(x @ W_gate) * (x @ W_up), W_gate / W_up the halves of w's columns, and the halves really used: the
    same as the model's silu_mul over moe_gmm's [D, 2, I] weights."""
    from deepinfer_jax.models.layers import silu_mul

    G, K, I = 3, 128, 256
    be = jnp.array([2, -1, 0, 2], jnp.int32)
    R = be.shape[0] * tile_m
    kx, kw = jax.random.split(jax.random.key(tile_m + steps))
    x = jax.random.normal(kx, (R, K), jnp.bfloat16)
    w4 = (jax.random.normal(kw, (G, K, 2, I)) * 0.1).astype(jnp.bfloat16)  # moe_gmm's gate_up layout
    w = w4.reshape(G, K, 2 * I)
    got = grouped_swiglu(x, w, be, tile_m=tile_m, tile_n=tile_n, tile_k=64, steps=steps, width=2, interpret=True)
    assert got.shape == (R, I)
    valid = np.repeat(np.asarray(be) >= 0, tile_m)
    want = grouped_swiglu_reference(x, w, be, tile_m)
    _close(got, want, valid)
    rows = slice(0, tile_m)  # block 0: expert 2
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    direct = silu_mul(f32(x[rows]) @ f32(w4[2, :, 0]), f32(x[rows]) @ f32(w4[2, :, 1])).astype(jnp.bfloat16)
    _close(want[rows], direct, np.ones(tile_m, bool))


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
    """Protocol A's prefill experts (16,384 x top-6 copies aligned to 128-row blocks, 26 layers x 64 experts): the
    down GEMM ([1,408, 2,048]) and the gate_up SwiGLU ([2,048, 2 x 1,408]), each one Mosaic GPU custom call."""
    s = jax.ShapeDtypeStruct
    R = -(-(16384 * 6 + 64 * 127) // 128) * 128
    args = (s((R, 1408), jnp.bfloat16), s((26 * 64, 1408, 2048), jnp.bfloat16), s((R // 128,), jnp.int32))
    hlo = jax.jit(lambda x, w, b: grouped_matmul(x, w, b, num_programs=132)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert hlo.count("stablehlo.custom_call @mosaic_gpu") == 1
    args = (s((R, 2048), jnp.bfloat16), s((26 * 64, 2048, 2 * 1408), jnp.bfloat16), s((R // 128,), jnp.int32))
    hlo = jax.jit(lambda x, w, b: grouped_swiglu(x, w, b, num_programs=132)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert hlo.count("stablehlo.custom_call @mosaic_gpu") == 1 and "tensor<106496x1408xbf16>" in hlo


def test_moe_experts_take_the_mosaic_kernels_at_prefill_sizes(monkeypatch):
    """RunnerConfig.moe_prefill_mosaic's path (moe_gmm.moe_experts(mosaic=True)): at a step of prefill size (the
    threshold lowered to these copies) the Mosaic kernels run, over XLA's gather of the rows and a layer of stacked
    weights, and the MoE output equals the Triton kernels' and the reference's; below the threshold, or with the
    shared experts inside the kernels, the Triton kernels keep the step."""
    from deepinfer_jax.kernels import moe_gmm, moe_gmm_mgpu
    from deepinfer_jax.kernels.moe_gmm import moe_experts, moe_experts_reference

    L, E, D, I, T, k = 2, 4, 256, 128, 48, 2
    keys = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(keys[0], (T, D), jnp.bfloat16)
    wgu = (jax.random.normal(keys[1], (L, E, D, 2, I)) * 0.1).astype(jnp.bfloat16)
    wd = (jax.random.normal(keys[2], (L, E, I, D)) * 0.1).astype(jnp.bfloat16)
    w, idx = jax.lax.top_k(jax.nn.softmax(jax.random.normal(keys[3], (T, E))), k)
    idx = idx.astype(jnp.int32).at[0, 1].set(-1)  # a skipped copy (another device's expert)
    ran = []
    for name in ("grouped_swiglu", "grouped_matmul"):
        real = getattr(moe_gmm_mgpu, name)
        monkeypatch.setattr(moe_gmm_mgpu, name, lambda *a, real=real, name=name, **kw: (ran.append(name),
                                                                                          real(*a, **kw))[1])
    monkeypatch.setattr(moe_gmm, "MOSAIC_MIN_COPIES", T * k)
    run = lambda mosaic, **kw: moe_experts(x, wgu, wd, w, idx, layer=1, block_m=128, mosaic=mosaic,  # noqa: E731
                                           interpret=True, **kw)
    got = run(True)
    assert ran == ["grouped_swiglu", "grouped_matmul"]
    triton = run(False)
    _close(got, triton, np.ones(T, bool))
    # the reference at layer 1, the skipped copy as a copy of weight 0
    ref = moe_experts_reference(x, wgu[1], wd[1], jnp.where(idx >= 0, w, 0.0), jnp.maximum(idx, 0))
    _close(got, ref, np.ones(T, bool))
    ran.clear()
    monkeypatch.setattr(moe_gmm, "MOSAIC_MIN_COPIES", T * k + 1)
    run(True)
    assert ran == []  # under the threshold: the Triton kernels


def test_paged_forward_takes_the_mosaic_kernels_at_prefill_sizes(monkeypatch):
    """RunnerConfig.moe_prefill_mosaic through models/deepseek.py forward_paged (bf16, the shared MLP apart as at
    prefill sizes, 128-row blocks and the threshold lowered to this step): the MoE layers' experts run on the
    Mosaic kernels, and the logits equal those of the Triton kernels' path; off, the Mosaic kernels never run."""
    from hf_models import CASES, COMMON
    from paged_steps import step

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.kernels import moe_gmm, moe_gmm_mgpu
    from deepinfer_jax.models.cache import init_kv_cache
    from deepinfer_jax.models.params import init_params

    hf = {**COMMON, **CASES["v2_greedy_yarn"], "hidden_size": 256, "moe_intermediate_size": 128,
          "num_hidden_layers": 3, "architectures": ["DeepseekV2ForCausalLM"]}
    hf["rope_scaling"] = hf.pop("rope_parameters")
    cfg = ModelConfig.from_hf_dict(hf)
    params = init_params(cfg, 0, jnp.bfloat16, std=0.05)
    ran = []
    for name in ("grouped_swiglu", "grouped_matmul"):
        real = getattr(moe_gmm_mgpu, name)
        monkeypatch.setattr(moe_gmm_mgpu, name, lambda *a, real=real, name=name, **kw: (ran.append(name),
                                                                                          real(*a, **kw))[1])
    monkeypatch.setattr(moe_gmm, "MOSAIC_MIN_COPIES", 64)
    monkeypatch.setattr(moe_gmm, "tile_config", lambda n: (128, 128, 64, 8, 4))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40))
    logits = {}
    for mosaic in (False, True):
        cache = init_kv_cache(cfg, 16, 8, jnp.bfloat16)
        out, _ = step(params, cfg, cache, ids, [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], [(0, 40), (0, 40)],
                      moe_impl="pallas_interpret", moe_prefill_mosaic=mosaic, fuse_shared_experts=False)
        logits[mosaic] = np.asarray(out, np.float32)
        assert ran == (["grouped_swiglu", "grouped_matmul"] if mosaic else [])  # the MoE layers' scan, traced once
    np.testing.assert_allclose(logits[True], logits[False], rtol=0, atol=2e-2 * np.abs(logits[False]).max())
