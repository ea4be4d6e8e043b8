"""FP8 weights on the Pallas path (interpret mode): a decode-size step reads o_proj and the dense MLP through the
block-scaled FP8 GEMM (W8A8, kernels/fp8_gemm.py) and the routed experts through the quantized grouped GEMMs
(kernels/moe_gmm_quant.py), each weight read in place as the checkpoint stores it. The paged forward equals the
reference path (every FP8 leaf dequantized in its matmul) within FP8's activation rounding, and its traced step
holds no full-size dequantized copy of the experts."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from hf_models import CASES, COMMON
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.kernels import fp8_gemm, moe_gmm_quant
from deepinfer_jax.models import quant
from deepinfer_jax.models.cache import StepMetadata, init_kv_cache
from deepinfer_jax.models.decode_kernels import decode_stacked
from deepinfer_jax.models.deepseek import forward_paged
from deepinfer_jax.models.params import init_params, layer_segments

BLOCK = (32, 32)  # (bn, bk): the test model's dims are multiples, and 32-deep K steps suit the FP8 dots
PAGE = 16


@pytest.fixture(scope="module")
def fp8_model():
    cfg = ModelConfig.from_hf_dict({**COMMON, **CASES["v3_flat_plain_rope"]})
    params = init_params(cfg, seed=0, dtype=jnp.float32, std=0.05)
    return cfg, quant.quantize_params_fp8(params, BLOCK)


def _meta(ids, start, n, width=16):
    tid, pos = np.zeros(width, np.int32), np.zeros(width, np.int32)
    slot = (np.arange(width) % PAGE).astype(np.int32)  # padding -> the null page
    for i, p in enumerate(range(start, start + n)):
        tid[i], pos[i], slot[i] = ids[p], p, (1 + p // PAGE) * PAGE + p % PAGE
    table = np.array([[1, 2, 0, 0]], np.int32)
    return StepMetadata(jnp.asarray(tid), jnp.asarray(pos), jnp.zeros(width, jnp.int32), jnp.asarray(slot),
                        jnp.asarray(table), jnp.asarray([n - 1], jnp.int32))


def test_the_rule_routes_decode_projections(fp8_model, monkeypatch):
    cfg, params = fp8_model
    segs = list(zip(layer_segments(cfg), params["segments"]))
    # V3-size weights only by default: the test model's projections stay on the reference
    assert not any(decode_stacked(sp, 16, "pallas_interpret", None, True) for _, sp in segs)
    monkeypatch.setattr(quant, "FP8_GEMM_MIN_ELEMENTS", 0)
    for seg, sp in segs:
        mlp = {("mlp", "gate_up"), ("mlp", "down")} if seg.kind == "dense" else set()
        assert set(decode_stacked(sp, 16, "pallas_interpret", None, True)) == {("attn", "o_proj")} | mlp
        assert not decode_stacked(sp, 128, "pallas_interpret", None, True)  # a prefill-size step: the reference
    assert quant.fp8_kernel_act(16, experts=True) == "fp8" and quant.fp8_kernel_act(128, experts=True) == "bf16"


def _float_arrays(jaxpr) -> list[tuple]:
    out = []
    for eqn in jaxpr.eqns:
        out += [tuple(v.aval.shape) for v in eqn.outvars
                if hasattr(v.aval, "shape") and jnp.issubdtype(v.aval.dtype, jnp.floating)]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += _float_arrays(sub)
    return out


def test_paged_forward_through_the_fp8_kernels_equals_the_reference(fp8_model, monkeypatch):
    """W8A16 (x unrounded): the kernels' step equals the reference to fp32 rounding, so the wiring (weights read
    in place, gate / up order, block orientation) is exact. W8A8 rounds each 1 x 32 activation group to e4m3
    (3 mantissa bits): the prefill step's logits within 6% of their scale, the same greedy token. (A token whose
    top-k scores nearly tie can pick another expert under that rounding, a discontinuity of the model rather than
    an error of the kernels: here token 7 in the first MoE layer, and token 12, the decode step, in the last one,
    which moves its logits by 30%; so the decode step is compared in W8A16 only.)"""
    cfg, params = fp8_model
    monkeypatch.setattr(quant, "FP8_GEMM_MIN_ELEMENTS", 0)  # the test model's small projections too
    calls = {"gemm": 0, "experts": 0}
    gemm, experts = fp8_gemm.fp8_matmul, moe_gmm_quant.moe_experts_quant

    def spy(name, fn):
        def call(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return call

    monkeypatch.setattr(fp8_gemm, "fp8_matmul", spy("gemm", gemm))
    monkeypatch.setattr(moe_gmm_quant, "moe_experts_quant", spy("experts", experts))
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, 12)

    def run(kernels: bool, decode: bool):
        kw = dict(attn_impl="pallas_interpret", moe_impl="pallas_interpret", decode_projection_kernel=True)
        step = jax.jit(lambda p, c, m: forward_paged(p, cfg, c, m, return_routing=True, **(kw if kernels else {})))
        cache = init_kv_cache(cfg, 4, PAGE, jnp.float32)
        logits, cache, routes = step(params, cache, _meta(ids, 0, 11))  # 11 tokens in a 16-slot (decode-size) step
        out = [np.asarray(logits)]
        if decode:
            out.append(np.asarray(step(params, cache, _meta(ids, 11, 1))[0]))
        return out, np.sort(np.asarray(routes)[:, :11], axis=-1)

    ref, ref_routes = run(False, True)
    monkeypatch.setattr(quant, "FP8_DECODE_ACT", "bf16")
    w8a16, _ = run(True, True)
    # one trace: per segment o_proj (and the dense MLP's two GEMMs); the MoE segment's experts
    n_dense = sum(seg.kind == "dense" for seg in layer_segments(cfg))
    assert calls == {"gemm": len(layer_segments(cfg)) + 2 * n_dense, "experts": 1}
    for got, want in zip(w8a16, ref):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    monkeypatch.setattr(quant, "FP8_DECODE_ACT", "fp8")
    (w8a8,), routes = run(True, False)
    assert calls["gemm"] == 2 * (len(layer_segments(cfg)) + 2 * n_dense)  # traced again, W8A8
    assert (routes != ref_routes).any(-1).sum() <= 1  # near ties aside, the same experts
    err = np.abs(w8a8 - ref[0]).max() / np.abs(ref[0]).max()
    assert 1e-4 < err < 0.06, err  # rounded (not the W8A16 arithmetic), within e4m3's bound
    assert (w8a8.argmax(-1) == ref[0].argmax(-1)).all()

    moe = params["segments"][1]["moe"]["experts"]
    E, D, I, L = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, moe["down"].q.shape[0]
    full = {(E, D, 2, I), (E, I, D), (E, 2, I, D), (E, D, I), (L, E, 2, I, D), (L, E, D, I)}
    jaxpr = jax.make_jaxpr(lambda p, c, m: forward_paged(p, cfg, c, m, attn_impl="pallas_interpret",
                                                         moe_impl="pallas_interpret"))(
        params, init_kv_cache(cfg, 4, PAGE, jnp.float32), _meta(ids, 11, 1)).jaxpr
    assert not [s for s in _float_arrays(jaxpr) if s in full]
