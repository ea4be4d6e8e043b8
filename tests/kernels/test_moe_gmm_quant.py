"""The MoE grouped GEMMs on quantized experts (INT8, INT4, FP8 block-scaled; interpret mode) equal their
pure-JAX reference, and lower for sm_90."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels.fp8_gemm import FP8
from deepinfer_jax.kernels.moe_gmm import moe_experts_reference
from deepinfer_jax.kernels.moe_gmm_quant import (WeightFormat, _tiles, dequant_expert, fp4_block_k, moe_experts_quant,
                                                 moe_experts_quant_reference, supported)
from deepinfer_jax.models.quant import dequantize, quantize

T, D, I, E, K = 7, 192, 96, 5, 3  # odd tokens and experts; D, I multiples of 32 but not of 64 / 128 tiles


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    idx = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]), jnp.int32)
    w = jnp.asarray(rng.random((T, K)), jnp.float32)
    wgu = rng.standard_normal((2, E, D, 2, I)).astype(np.float32) * 0.1  # two stacked layers
    wd = rng.standard_normal((2, E, I, D)).astype(np.float32) * 0.1
    return x, idx, w, wgu, wd


def _weights(kind, wgu, wd):
    """(gate_up q, scale, down q, scale, formats) of both layers in `kind`'s stored layout."""
    rng = np.random.default_rng(1)
    if kind in ("int8", "int4"):
        bits = int(kind[3:])
        a, b = quantize(wgu, bits, 1, 2, 64), quantize(wd, bits, 1, 1, 48)  # INT4 down: 48-row groups, 32-row steps
        return a.q, a.scale, b.q, b.scale, WeightFormat(kind, a.group_size), WeightFormat(kind, b.group_size)
    act = kind.split("-")[1]

    def fp8(w, blk, n_out):
        s_shape = w.shape[:2] + (w.shape[2] // blk[0],) + ((2,) if n_out == 2 else ()) + (w.shape[-1] // blk[1],)
        return jnp.asarray(w * 10, FP8), jnp.asarray(rng.random(s_shape) * 0.1 + 0.05, jnp.float32)

    # gate_up in 64 x 32 blocks, down in 32 x 64: with act="fp8" the gate_up tile (32 columns) is the down
    # weight's 1 x 32 activation group, so h is quantized in the gate_up kernel's epilogue
    return (*fp8(wgu, (64, 32), 2), *fp8(wd, (32, 64), 1), WeightFormat("fp8", 64, 32, act),
            WeightFormat("fp8", 32, 64, act))


def _close(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=1e-2 * np.abs(ref).max())


def _nk(gq, gs, dq, ds, fg, fd):
    """FP8 "kn" experts in the checkpoint's orientation: gate_up [L, E, 2, I, D] / [L, E, 2, I/bn, D/bk], down
    [L, E, D, I] / [L, E, D/bn, I/bk]."""
    t = lambda a: jnp.moveaxis(a, 2, -1)  # noqa: E731  [L, E, D, 2, I] -> [L, E, 2, I, D]
    fmt = lambda f: dataclasses.replace(f, layout="nk")  # noqa: E731
    return t(gq), t(gs), jnp.swapaxes(dq, -1, -2), jnp.swapaxes(ds, -1, -2), fmt(fg), fmt(fd)


@pytest.mark.parametrize("kind, swap_ab", [("int8", None), ("int4", None), ("fp8nk-bf16", None), ("fp8-fp8", None),
                                           ("fp8nk-fp8", True), ("fp8nk-bf16", True)])
def test_kernels_match_reference(case, kind, swap_ab):
    """Layer 1 of the stacked weights, read in place, against the reference on that layer's weights; FP8 "nk"
    weights (HF's orientation, read as stored) against the reference on the same weights in "kn"; with swap_ab the
    FP8 products are the transposed ones, [tn, bm] (the weight tile first), transposed back in the epilogues."""
    x, idx, w, wgu, wd = case
    gq, gs, dq, ds, fg, fd = ref_w = _weights(kind.replace("nk", ""), wgu, wd)
    if "nk" in kind:
        gq, gs, dq, ds, fg, fd = _nk(*ref_w)
    assert supported(fg, fd, D, I, T * K)
    out = moe_experts_quant(x, gq, gs, dq, ds, w, idx, jnp.int32(1), fmt_gu=fg, fmt_down=fd, swap_ab=swap_ab,
                            interpret=True)
    rq = [a[1] for a in ref_w[:4]]
    ref = moe_experts_quant_reference(x, *rq, w, idx, fmt_gu=ref_w[4], fmt_down=ref_w[5])
    _close(out, ref)
    if "nk" in kind:  # the reference's own dequant of the "nk" weights is the "kn" one's
        np.testing.assert_array_equal(np.asarray(dequant_expert(gq[1], gs[1], fg, 2)),
                                      np.asarray(dequant_expert(*rq[:2], ref_w[4], 2)))


@pytest.mark.parametrize("bits", [8, 4])
def test_reference_dequant_is_models_quant(case, bits):
    """The kernels' INT layouts are models/quant.py's: `dequant_expert` equals its `dequantize`, so the
    reference is the dequantize-then-bf16-GEMM path the model took before."""
    x, idx, w, wgu, wd = case
    a = quantize(wgu[0], bits, 1, 2, 64)
    np.testing.assert_array_equal(np.asarray(dequant_expert(a.q, a.scale, WeightFormat(f"int{bits}", a.group_size), 2)),
                                  np.asarray(dequantize(a, jnp.float32)))
    b = quantize(wd[0], bits, 1, 1, 48)
    ref = moe_experts_quant_reference(x, a.q, a.scale, b.q, b.scale, w, idx,
                                      fmt_gu=WeightFormat(f"int{bits}", a.group_size),
                                      fmt_down=WeightFormat(f"int{bits}", b.group_size))
    want = moe_experts_reference(x, dequantize(a, jnp.bfloat16), dequantize(b, jnp.bfloat16), w, idx)
    _close(ref, want)


def test_prefill_layout_and_skipped_copies(case):
    """Column tiles launched first (prefill sizes) and ids outside [0, E) keep the result; h quantized beside the
    kernels where the gate_up tile is not one activation group (16-wide tiles against 32-column groups)."""
    x, idx, w, wgu, wd = case
    gq, gs, dq, ds, fg, fd = _weights("fp8-fp8", wgu, wd)
    skip = jnp.asarray(np.random.default_rng(1).random(idx.shape) < 0.3)
    out = moe_experts_quant(x, gq[0], gs[0], dq[0], ds[0], jnp.where(skip, 0.0, w), jnp.where(skip, -1, idx),
                            fmt_gu=fg, fmt_down=fd, block_n=16, cols_first=True, interpret=True)
    ref = moe_experts_quant_reference(x, gq[0], gs[0], dq[0], ds[0], jnp.where(skip, 0.0, w),
                                      jnp.where(skip, 0, idx), fmt_gu=fg, fmt_down=fd)
    _close(out, ref)


def test_supported_formats():
    assert not supported(WeightFormat("int4", 64), WeightFormat("int4", 88), 2048, 176, 64)  # 16-deep steps only
    assert supported(WeightFormat("int4", 128), WeightFormat("int4", 88), 2048, 1408, 64)  # V2-Lite's groups
    assert not supported(WeightFormat("fp8", 128, 128, "fp8"), WeightFormat("fp8", 128, 128, "fp8"), 7168, 2000, 64)
    with pytest.raises(ValueError, match="act"):
        WeightFormat("int8", act="fp8")
    with pytest.raises(ValueError, match="layout"):
        WeightFormat("int4", 128, layout="nk")


@pytest.fixture
def triton_asm(cuda_lowering, monkeypatch):
    from jax._src.pallas.triton import pallas_call_registration as reg

    captured, lower = [], reg.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        out = lower(*a, **k)
        captured.append(out.module.operation.get_asm())
        return out

    monkeypatch.setattr(reg.lowering, "lower_jaxpr_to_triton_module", capture)
    return lambda fn, *args: (cuda_lowering(fn, *args), captured)[1]


@pytest.mark.parametrize("kind, tokens", [("fp8-fp8", 32), ("fp8nk-fp8", 4096), ("fp8nk-fp8", 32), ("int8", 32),
                                          ("int4", 32)])
def test_kernels_lower_for_sm90(triton_asm, kind, tokens):
    """V3-shaped experts (D 7168, I 2048, 256 experts, top-8; INT4 in 128-row groups) at decode and prefill
    sizes: both kernels lower, FP8 ones multiplying e4m3 by e4m3, the INT ones reading 1-byte weights."""
    S = jax.ShapeDtypeStruct
    Dv, Iv, Ev, L = 7168, 2048, 256, 2
    if kind == "fp8-fp8":
        f = WeightFormat("fp8", 128, 128, "fp8")
        ws = (S((L, Ev, Dv, 2, Iv), FP8), S((L, Ev, Dv // 128, 2, Iv // 128), jnp.float32),
              S((L, Ev, Iv, Dv), FP8), S((L, Ev, Iv // 128, Dv // 128), jnp.float32))
    elif kind == "fp8nk-fp8":
        f = WeightFormat("fp8", 128, 128, "fp8", "nk")
        ws = (S((L, Ev, 2, Iv, Dv), FP8), S((L, Ev, 2, Iv // 128, Dv // 128), jnp.float32),
              S((L, Ev, Dv, Iv), FP8), S((L, Ev, Dv // 128, Iv // 128), jnp.float32))
    elif kind == "int8":
        f = WeightFormat("int8")
        ws = (S((L, Ev, Dv, 2, Iv), jnp.int8), S((L, Ev, 1, 2, Iv), jnp.float32),
              S((L, Ev, Iv, Dv), jnp.int8), S((L, Ev, 1, Dv), jnp.float32))
    else:
        f = WeightFormat("int4", 128)
        ws = (S((L, Ev, Dv // 2, 2, Iv), jnp.uint8), S((L, Ev, Dv // 128, 2, Iv), jnp.float32),
              S((L, Ev, Iv // 2, Dv), jnp.uint8), S((L, Ev, Iv // 128, Dv), jnp.float32))
    args = (S((tokens, Dv), jnp.bfloat16), *ws, S((tokens, 8), jnp.float32), S((tokens, 8), jnp.int32),
            S((), jnp.int32))
    swap = kind == "fp8nk-fp8" and tokens < 256
    mods = triton_asm(lambda x, a, b, c, d, w, i, l: moe_experts_quant(x, a, b, c, d, w, i, l, fmt_gu=f, fmt_down=f,
                                                                       swap_ab=swap or None), *args)
    assert len(mods) == 2  # gate_up, down
    for asm in mods:
        dots = [ln for ln in asm.splitlines() if "tt.dot" in ln]
        assert dots
        if kind.startswith("fp8"):
            assert all(ln.count("f8E4M3FN>") >= 2 for ln in dots)
        else:
            assert "tt.ptr<i8>" in asm and "f8E4M3FN" not in asm
        if swap:  # the weight tile first: [128, 64] e4m3 times x's [64, 16] (the transposed 16-row block)
            assert all("tensor<128x64xf8E4M3FN> * tensor<64x16xf8E4M3FN>" in ln for ln in dots), dots


def _fp4(wgu, wd):
    """Both layers' experts as DeepSeek-V4's FP4 checkpoint stores them (models/quant_fp4.py): gate_up
    [L, E, 2, I, D/2] / [L, E, 2, I, D/32], down [L, E, D, I/2] / [L, E, D, I/32], e8m0 scale bytes."""
    from deepinfer_jax.models.quant_fp4 import quantize_fp4

    a, b = quantize_fp4(wgu, 2, gate_up=True), quantize_fp4(wd, 1)
    f = WeightFormat("fp4", 32, layout="nk")
    return jnp.asarray(a.q), jnp.asarray(a.scale), jnp.asarray(b.q), jnp.asarray(b.scale), f, f, a, b


@pytest.mark.parametrize("hidden, block_k, swap_ab", [(64, None, False), (128, 128, False), (128, 128, True)])
def test_fp4_kernels_match_reference(case, hidden, block_k, swap_ab):
    """FP4 experts read in place (layer 1 of two, V4's swiglu_limit) against the reference on that layer; the
    reference's dequant is models/quant_fp4.py's (exact). gate_up's K steps are 64 (two 32-column groups) at the
    default tiles, 128 (four) at block_k 128; down's K (width 96) is no multiple of either: 32-column steps. With
    swap_ab the products are the transposed ones, [tn, bm], transposed back in the epilogues."""
    from deepinfer_jax.models.quant_fp4 import fp4_dequantize

    x, idx, w, wgu, wd = case
    x, wgu, wd = x[:, :hidden], wgu[:, :, :hidden], wd[..., :hidden]
    gq, gs, dq, ds, fg, fd, a, b = _fp4(wgu, wd)
    assert _tiles(fg, hidden, I, 128, block_k or 64)[0] == (block_k or 64)
    assert _tiles(fd, I, hidden, 128, block_k or 64)[0] == 32
    assert supported(fg, fd, hidden, I, T * K)
    out = moe_experts_quant(x, gq, gs, dq, ds, w, idx, jnp.int32(1), fmt_gu=fg, fmt_down=fd, swiglu_limit=0.3,
                            block_k=block_k, swap_ab=swap_ab, interpret=True)
    ref = moe_experts_quant_reference(x, gq[1], gs[1], dq[1], ds[1], w, idx, fmt_gu=fg, fmt_down=fd,
                                      swiglu_limit=0.3)
    _close(out, ref)
    np.testing.assert_array_equal(np.asarray(dequant_expert(gq, gs, fg, 2)),
                                  np.asarray(fp4_dequantize(a, jnp.float32)))


def test_fp4_decode_is_the_e2m1_table():
    """Every byte's two codes (low nibble first) decode bit for bit to the e2m1 table, -0 included."""
    from deepinfer_jax.kernels.fp4 import E2M1_VALUES, fp4_unpack

    b = np.arange(256, dtype=np.uint8)
    lut = np.array(E2M1_VALUES, np.float32)
    want = np.stack([lut[b & 15], lut[b >> 4]], -1).reshape(-1)
    np.testing.assert_array_equal(np.asarray(fp4_unpack(jnp.asarray(b))).view(np.int32), want.view(np.int32))


def test_fp4_formats():
    assert supported(WeightFormat("fp4", 32, layout="nk"), WeightFormat("fp4", 32, layout="nk"), 4096, 2048, 64)
    assert not supported(WeightFormat("fp4", 32, layout="nk"), WeightFormat("fp4", 32, layout="nk"), 40, 24, 8)
    f = WeightFormat("fp4", 32, layout="nk")
    # K steps: the largest power of two dividing K up to block_k, whole groups each
    assert [_tiles(f, 4096, 2048, 128, bk) for bk in (32, 64, 256)] == [(32, 128), (64, 128), (256, 128)]
    # the default cap: 8 KiB of bytes a tile a step (128-wide tiles: 128 columns; 256-wide: 64), never under a group
    assert [fp4_block_k(tn) for tn in (16, 128, 256, 1024)] == [1024, 128, 64, 32]
    assert _tiles(f, 96, 128, 128, 64) == (32, 128) and _tiles(f, 192, 128, 128, 256) == (64, 128)
    # a 64-column group (not DeepSeek's): steps inside one group or of whole ones, never straddling two
    assert _tiles(WeightFormat("fp4", 64, layout="nk"), 192, 128, 128, 128) == (64, 128)
    assert _tiles(WeightFormat("fp4", 96, layout="nk"), 192, 128, 128, 128) == (32, 128)
    with pytest.raises(ValueError, match="layout"):
        WeightFormat("fp4", 32)


@pytest.mark.parametrize("swap_ab", [False, True, None])
def test_fp4_kernels_lower_for_sm90(triton_asm, swap_ab):
    """V4-Flash's routed experts (D 4096, I 2048, 256 experts, top-6) in FP4 at a decode size: both kernels lower
    and read 1-byte weights and scales (no float copy of the experts), decode them in the PTX block (never
    interleaving the nibble halves), and run two 64-deep dots a K step for each output (`fp4_block_k`: a
    128-column step of 128-wide tiles, four 32-column groups; its even columns and its odd ones); with swap_ab the
    decoded tile is each dot's first operand, as by default (None) at this size's 16-row blocks."""
    S = jax.ShapeDtypeStruct
    Dv, Iv, Ev, T4 = 4096, 2048, 256, 32
    f = WeightFormat("fp4", 32, layout="nk")
    args = (S((T4, Dv), jnp.bfloat16), S((Ev, 2, Iv, Dv // 2), jnp.uint8), S((Ev, 2, Iv, Dv // 32), jnp.uint8),
            S((Ev, Dv, Iv // 2), jnp.uint8), S((Ev, Dv, Iv // 32), jnp.uint8), S((T4, 6), jnp.float32),
            S((T4, 6), jnp.int32))
    mods = triton_asm(lambda x, a, b, c, d, w, i: moe_experts_quant(x, a, b, c, d, w, i, fmt_gu=f, fmt_down=f,
                                                                    swiglu_limit=10.0, swap_ab=swap_ab), *args)
    assert len(mods) == 2
    swapped = swap_ab is not False
    shapes = "tensor<128x64xbf16> * tensor<64x16xbf16>" if swapped else "tensor<16x64xbf16> * tensor<64x128xbf16>"
    for asm, n_dots in zip(mods, (4, 2)):  # gate and up; down
        dots = [ln for ln in asm.splitlines() if "tt.dot" in ln]
        assert "tt.ptr<i8>" in asm and "tt.join" not in asm
        assert asm.count("tt.elementwise_inline_asm") == n_dots // 2 and "prmt.b32" in asm
        assert len(dots) == n_dots and all(shapes in ln for ln in dots), dots
