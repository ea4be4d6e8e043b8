"""The block-scaled FP8 dense GEMM (interpret mode) equals its pure-JAX references, and lowers for sm_90."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels import fp8_gemm
from deepinfer_jax.kernels.fp8_gemm import FP8, fp8_matmul, fp8_matmul_reference, quantize_act


def _case(seed, M, K, N, block, L=None):
    rng = np.random.default_rng(seed)
    lead = () if L is None else (L,)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal(lead + (K, N)) * 50, FP8)
    kb, nb = -(-K // block[0]), -(-N // block[1])
    scale = jnp.asarray(rng.random(lead + (kb, nb)) * 2e-3 + 1e-4, jnp.float32)
    return x, q, scale


def _close(out, ref):
    """bf16 outputs equal up to fp32 summation order and one bf16 rounding."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    np.testing.assert_allclose(out, ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())


@pytest.mark.parametrize("M, K, N, block, act, L, layout", [
    (5, 192, 96, (64, 32), "fp8", None, "kn"),      # odd rows, tiles of the block's size
    (1, 256, 48, (128, 16), "bf16", None, "nk"),    # one token: split K, 16-wide column tiles; HF's [N, K]
    (33, 256, 64, (32, 64), "fp8", 3, "nk"),        # stacked layers, 32-deep blocks, rows over one tile
    (70, 128, 96, (64, 96), "bf16", 2, "kn"),       # bn 96: 32-wide tiles inside a block, rows over 64
    (1100, 64, 48, (32, 16), "fp8", 2, "nk"),       # prefill tiles: 9 row tiles of 128, a second, partial group
])
def test_kernel_matches_reference(M, K, N, block, act, L, layout):
    """The kernel against the reference of its activation mode; "nk" weights (the checkpoint's [N, K] and its
    [N / bn, K / bk] scales, read as stored) against the reference on the [K, N] ones."""
    x, q, s = _case(M + K, M, K, N, block, L)
    layer = None if L is None else jnp.int32(L - 1)
    qk, sk = (q, s) if layout == "kn" else (jnp.swapaxes(q, -1, -2), jnp.swapaxes(s, -1, -2))
    out = fp8_matmul(x, qk, sk, layer, block=block, act=act, layout=layout, interpret=True)
    _close(out, fp8_matmul_reference(x, q, s, block, layer, act_quant=act == "fp8"))


def test_prefill_grid_visits_every_tile_once():
    """The grouped 1-D order (`_tile_of`) is a permutation of the (n, m) tiles, for row counts around GROUP_M."""
    from deepinfer_jax.kernels.fp8_gemm import GROUP_M, _tile_of

    for num_m, num_n in [(1, 5), (GROUP_M, 3), (GROUP_M + 3, 4), (3 * GROUP_M - 1, 2)]:
        n, m = _tile_of(jnp.arange(num_m * num_n), num_m, num_n)
        assert sorted(zip(np.asarray(n).tolist(), np.asarray(m).tolist())) == [
            (a, b) for a in range(num_n) for b in range(num_m)]


def test_act_quant_error_is_fp8_sized():
    """W8A8's rounding of x (1 x bk groups, e4m3's 3 mantissa bits) moves the result by a few percent of its
    scale at most; the exact-dequant reference is the W8A16 kernel's."""
    x, q, s = _case(1, 16, 256, 64, (128, 64))
    exact = np.asarray(fp8_matmul_reference(x, q, s, (128, 64)), np.float32)
    act = np.asarray(fp8_matmul_reference(x, q, s, (128, 64), act_quant=True), np.float32)
    err = np.abs(act - exact).max() / np.abs(exact).max()
    assert 1e-4 < err < 0.05, err


def test_quantize_act_groups():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 100)), jnp.float32).at[1, :64].set(0.0)
    xq, xs = quantize_act(x, 64)  # a ragged last group of 36 columns
    assert xq.dtype == FP8 and xq.shape == (3, 100) and xs.shape == (3, 2)
    assert float(xs[1, 0]) == 1.0  # an all-zero group
    np.testing.assert_allclose(np.asarray(xs[0, 0]), np.abs(np.asarray(x[0, :64])).max() / 448.0, rtol=1e-6)
    back = np.asarray(xq, np.float32) * np.repeat(np.asarray(xs), 64, axis=1)[:, :100]
    np.testing.assert_allclose(back, np.asarray(x), rtol=2 ** -4, atol=1e-6)  # e4m3: half an ulp of 2^-3


def test_reference_dequantizes_ragged_blocks_per_block():
    """A [100, 40] weight in 64 x 32 blocks: the last row and column blocks are partial (cdiv scales)."""
    x, q, s = _case(3, 4, 100, 40, (64, 32))
    w = np.asarray(q, np.float32)
    sn = np.asarray(s)
    for i in range(100):
        for j in range(40):
            w[i, j] *= sn[i // 64, j // 32]
    want = np.asarray(x, np.float32) @ w
    _close(fp8_matmul_reference(x, q, s, (64, 32)), want)
    assert not fp8_gemm.supported(100, 40, (64, 32)) and fp8_gemm.supported(128, 64, (64, 32))
    assert not fp8_gemm.supported(128, 64, (16, 32))  # FP8 dots need 32-deep K tiles
    with pytest.raises(ValueError, match="no kernel tiling"):
        fp8_matmul(x, q, s, block=(64, 32), interpret=True)


@pytest.fixture
def triton_asm(cuda_lowering, monkeypatch):
    """lower(fn, *args) -> the Triton modules (text) of fn's kernels, lowered for sm_90 on this CPU machine."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    captured, lower = [], reg.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        out = lower(*a, **k)
        captured.append(out.module.operation.get_asm())
        return out

    monkeypatch.setattr(reg.lowering, "lower_jaxpr_to_triton_module", capture)
    return lambda fn, *args: (cuda_lowering(fn, *args), captured)[1]


def fp8_dots(asm: str) -> list[str]:
    """The tt.dot lines of a module whose operands are both e4m3 tensors."""
    return [ln for ln in asm.splitlines() if "tt.dot" in ln and ln.count("f8E4M3FN>") >= 2]


@pytest.mark.parametrize("M, act, layout", [(32, "fp8", "kn"), (4096, "fp8", "nk"), (32, "bf16", "nk")])
def test_kernel_lowers_for_sm90(triton_asm, M, act, layout):
    """V3's q_b projection [1536, 24576] at decode and prefill sizes: act="fp8" multiplies e4m3 by e4m3 (the FP8
    tensor cores), act="bf16" widens the weight tile first."""
    S = jax.ShapeDtypeStruct
    q, s = ((1536, 24576), (12, 192)) if layout == "kn" else ((24576, 1536), (192, 12))
    args = (S((M, 1536), jnp.bfloat16), S((2, *q), FP8), S((2, *s), jnp.float32), S((), jnp.int32))
    (asm,) = triton_asm(lambda x, q, s, layer: fp8_matmul(x, q, s, layer, act=act, layout=layout), *args)
    assert bool(fp8_dots(asm)) == (act == "fp8")
    assert "tt.dot" in asm
