"""Block-scaled FP8 dense GEMM in Pallas (Triton backend), DeepSeek-V3's weight format.

    y = x @ (q * scale expanded per block)     x [M, K] bf16, q [K, N] float8_e4m3fn,
                                               scale [cdiv(K, bk), cdiv(N, bn)] fp32 -> y [M, N] bf16

Weights come in either orientation (`layout`): "kn", q [K, N] with scale [K / bk, N / bn] as above, or "nk",
the checkpoint's own [out, in] = [N, K] with `weight_scale_inv` [N / bn, K / bk] as HF stores it
(models/quant.py's Fp8Weight keeps that orientation; the kernel multiplies by the transposed tile, so no
transposed copy is made). `block` is (bk, bn) in both. Two activation modes:

- act="fp8" (W8A8, what FP8 tensor cores need: wgmma takes both operands in FP8): x is quantized per token
  group of 1 x bk columns (`quantize_act`, DeepSeek-V3's training recipe: one fp32 scale per token per 128
  columns, amax / 448), beside the kernel (one fused XLA pass over x, small next to the weights). Each K step
  of the kernel is one scale block deep at most: its FP8 product, exact in fp32, is scaled by the token's
  and the block's scales and added to the fp32 accumulator (DeepGEMM's "promotion" of partial sums).
- act="bf16" (W8A16): x stays bf16 and each weight tile is widened to bf16 in the kernel (e4m3 values are
  exact in bf16), the product scaled by the block's scale. Same weight bytes, no activation rounding.

At decode sizes (M <= 64) the grid is (N // tile_n, M_pad // tile_m, split_k): program (n, m, s) accumulates K
chunk s of its tile and writes an fp32 partial, summed in JAX (XLA fuses the sum into the consumer); `plan`
splits K so that about 128 programs stream the weight, as kernels/decode_matmul.py. Above, each program owns a
whole output tile, on a 1-D grid ordered in groups of row tiles so that a weight tile is read from HBM once per
group rather than once per row tile (`_tile_of`), and writes x's dtype directly.
With `layer`, q [L, K, N] and scale [L, kb, nb] are read at that layer in place (the model's stacked weights).

Three parts (ARCHITECTURE.md rule 6): `fp8_matmul` (the kernel; `interpret=True` runs it on the CPU),
`fp8_matmul_reference` (pure JAX: the exact-dequant product, or with `act_quant` the act="fp8" arithmetic)
and `supported` (the kernel's shape predicate; callers use the reference elsewhere). Invariants: K % bk == 0,
N % bn == 0, and bk, bn have power-of-two tiles (tile_k of at least 32 for FP8 dots, tile_n of at least 16)
that divide them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.kernels.decode_matmul import fewest_chunks, largest_pow2_divisor
from deepinfer_jax.kernels.triton_params import compiler_params

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
EXACT = jax.lax.Precision.HIGHEST
DECODE_MAX_TOKENS = 64  # up to here K is split over programs (a weight stream); above, one chunk a tile


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_act(x: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (xq [M, K] float8_e4m3fn, xs [M, cdiv(K, group)] fp32) with x ~= xq * xs per 1 x group
    block: xs = amax / 448 (1 for an all-zero group), xq = x / xs rounded to e4m3 (DeepSeek-V3's act_quant)."""
    M, K = x.shape
    nk = _cdiv(K, group)
    xf = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, nk * group - K))).reshape(M, nk, group)
    amax = jnp.max(jnp.abs(xf), axis=-1)  # [M, nk]
    xs = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    xq = (xf / xs[..., None]).astype(FP8).reshape(M, nk * group)[:, :K]
    return xq, xs


def expand_scale(scale: jax.Array, block: tuple[int, int], K: int, N: int) -> jax.Array:
    """scale [.., cdiv(K, bk), cdiv(N, bn)] -> [.., K, N]: each block's scale over its elements."""
    bk, bn = block
    s = jnp.repeat(jnp.repeat(scale, bk, axis=-2), bn, axis=-1)
    return s[..., :K, :N]


def dequant_fp8(q: jax.Array, scale: jax.Array, block: tuple[int, int]) -> jax.Array:
    """q [.., K, N] e4m3 and its block scales -> the fp32 weight [.., K, N]."""
    K, N = q.shape[-2:]
    return q.astype(jnp.float32) * expand_scale(scale.astype(jnp.float32), block, K, N)


def to_kn(q, scale, layout: str):
    """(q [.., K, N], scale [.., K / bk, N / bn]) from either orientation (a transposed copy for "nk")."""
    if layout == "kn":
        return q, scale
    return jnp.swapaxes(q, -1, -2), jnp.swapaxes(scale, -1, -2)


def fp8_matmul_reference(x, q, scale, block, layer=None, *, act_quant=False, layout="kn"):
    """Pure JAX. act_quant=False: x @ dequant(q) in fp32 (the exact-dequant product, act="bf16"'s arithmetic up
    to summation order). act_quant=True: x first rounded through `quantize_act` (1 x bk groups), as the
    act="fp8" kernel computes (each FP8 product is exact in fp32, so only the order of the sums differs).
    x [M, K], q [(L,) K, N], scale [(L,) kb, nb] (or both transposed, layout "nk") -> [M, N] in x's dtype."""
    q, scale = to_kn(q, scale, layout)
    if layer is not None:
        q = jax.lax.dynamic_index_in_dim(q, layer, keepdims=False)
        scale = jax.lax.dynamic_index_in_dim(scale, layer, keepdims=False)
    xf = x.astype(jnp.float32)
    if act_quant:
        xq, xs = quantize_act(x, block[0])
        xf = xq.astype(jnp.float32) * jnp.repeat(xs, block[0], axis=1)[:, : x.shape[1]]
    return jnp.dot(xf, dequant_fp8(q, scale, block), precision=EXACT).astype(x.dtype)


def tiles_for(block: tuple[int, int]) -> tuple[int, int] | None:
    """(tile_k, tile_n) for a scale block (bk, bn): the largest power-of-two divisors up to 128, or None when
    the block has none large enough (tile_k >= 32: FP8 dots take 32-deep K steps; tile_n >= 16)."""
    bk, bn = block
    tk, tn = largest_pow2_divisor(bk, 128), largest_pow2_divisor(bn, 128)
    return (tk, tn) if tk >= 32 and tn >= 16 else None


def supported(K: int, N: int, block: tuple[int, int]) -> bool:
    """Whether `fp8_matmul` takes a [K, N] weight of this block size: whole blocks along K and N, and tiles that
    divide the blocks. Elsewhere (a ragged last block) callers use `fp8_matmul_reference`."""
    bk, bn = block
    return K % bk == 0 and N % bn == 0 and tiles_for(block) is not None


def plan(M: int, K: int, N: int, block: tuple[int, int]) -> tuple[int, int, int, int, int, int]:
    """(tile_m, tile_k, tile_n, split_k, num_warps, num_stages). Decode sizes (M <= 64): tile_m 16 / 32 / 64 and
    K split so that about 128 programs stream the weight. Above, the tensor cores' shapes for FP8 wgmma (vLLM's
    w8a8_block_fp8_matmul configs for H100 take the same): 64 x 128 x 128 tiles, 4 warps, 4 stages up to 256 rows;
    from 257 rows 128 x 128 x 128 tiles on 8 warps (two warpgroups), 3 stages (96 KiB of FP8 tiles in flight),
    in `GROUP_M`-row groups (`_tile_of`)."""
    tk, tn = tiles_for(block)
    if M <= DECODE_MAX_TOKENS:
        tm = 16 if M <= 16 else 32 if M <= 32 else 64
        return tm, tk, tn, fewest_chunks(N // tn, K // tk), 4, 4
    if M <= 256:
        return 64, tk, tn, 1, 4, 4
    return 128, tk, tn, 1, 8, 3


GROUP_M = 8  # row tiles whose programs run side by side at prefill sizes, sharing each weight tile in L2


def _tile_of(pid, num_m: int, num_n: int):
    """(n, m) of program pid on a 1-D grid, in groups of GROUP_M row tiles (Triton's matmul ordering): the programs
    in flight cover a few row tiles by many column tiles, so each weight tile read from HBM serves GROUP_M row tiles
    from L2, where a column-major order re-reads the whole weight for every row tile (M / tile_m times)."""
    per_group = GROUP_M * num_n
    first = (pid // per_group) * GROUP_M
    size = jnp.minimum(num_m - first, GROUP_M)
    return (pid % per_group) // size, first + (pid % per_group) % size


def dot_nk(a, b, **kw):
    """a [m, k] @ b.T for b [n, k] (a tile of an [N, K] weight), fp32 out."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, **kw)


def _kernel(layer_ref, x_ref, xs_ref, q_ref, s_ref, o_ref, *, tk, tn, tm, bk, bn, k_steps, act, layout, grouped):
    if grouped:  # prefill sizes: one chunk of K, a 1-D grid in row groups, the output in x's dtype
        (n, m), s = _tile_of(pl.program_id(0), o_ref.shape[0] // tm, o_ref.shape[1] // tn), 0
    else:
        n, m, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    rows, cols = pl.ds(m * tm, tm), pl.ds(n * tn, tn)
    nb = (n * tn) // bn  # this tile's scale column (tn divides bn)

    def body(i, acc):
        k0 = (s * k_steps + i) * tk
        kb = k0 // bk
        if layout == "kn":
            w, scale = q_ref[layer, pl.ds(k0, tk), cols], s_ref[layer, kb, nb]  # [tk, tn] e4m3
            dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32)
        else:
            w, scale = q_ref[layer, cols, pl.ds(k0, tk)], s_ref[layer, nb, kb]  # [tn, tk] e4m3
            dot = dot_nk
        if act == "fp8":  # both operands FP8; the token's and the block's scales on the exact fp32 product
            part = dot(x_ref[rows, pl.ds(k0, tk)], w)
            return acc + part * (xs_ref[rows, kb][:, None] * scale)
        x = x_ref[rows, pl.ds(k0, tk)]
        return acc + dot(x, w.astype(x.dtype), precision=EXACT) * scale

    acc = jax.lax.fori_loop(0, k_steps, body, jnp.zeros((tm, tn), jnp.float32))
    if grouped:
        o_ref[rows, cols] = acc.astype(o_ref.dtype)
    else:
        o_ref[s, rows, cols] = acc


@functools.partial(jax.jit, static_argnames=("block", "act", "layout", "tile_m", "split_k", "num_warps",
                                             "num_stages", "out_dtype", "interpret"))
def fp8_matmul(x, q, scale, layer=None, *, block=(128, 128), act="fp8", layout="kn", tile_m=None, split_k=None,
               num_warps=None, num_stages=None, out_dtype=None, interpret=False):
    """x [M, K], q [(L,) K, N] float8_e4m3fn, scale [(L,) K // bk, N // bn] fp32 (layout "nk": q [(L,) N, K],
    scale [(L,) N // bn, K // bk]) -> [M, N] in `out_dtype` (x's dtype when None; fp32 for a partial sum that
    is reduced over devices after) (module docstring). `layer` (int32 scalar) indexes stacked q / scale in
    place. Tiles left as None come from `plan`."""
    if layout not in ("kn", "nk"):
        raise ValueError(f"fp8_matmul: layout must be 'kn' or 'nk', got {layout!r}")
    if act not in ("fp8", "bf16"):
        raise ValueError(f"fp8_matmul: act must be 'fp8' or 'bf16', got {act!r}")
    if q.dtype != FP8:
        raise ValueError(f"fp8_matmul: q must be float8_e4m3fn, got {q.dtype}")
    if layer is None:
        q, scale, layer = q[None], scale[None], 0
    M, K = x.shape
    _, K2, N = q.shape if layout == "kn" else (q.shape[0], q.shape[2], q.shape[1])
    bk, bn = block
    if K != K2 or not supported(K, N, block):
        raise ValueError(f"fp8_matmul: no kernel tiling for x {x.shape} @ q {q.shape[1:]} with block {block}")
    if scale.shape[1:] != ((K // bk, N // bn) if layout == "kn" else (N // bn, K // bk)):
        raise ValueError(f"fp8_matmul: scale {scale.shape[1:]} does not match q {q.shape[1:]} with block {block}")
    tm, tk, tn, split, warps, stages = plan(M, K, N, block)
    tm, split, warps, stages = tile_m or tm, split_k or split, num_warps or warps, num_stages or stages
    grouped = split == 1 and M > DECODE_MAX_TOKENS
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    m_pad = _cdiv(M, tm) * tm
    if act == "fp8":
        xk, xs = quantize_act(x, bk)  # [M, K] e4m3, [M, K // bk]
    else:
        xk, xs = x, jnp.zeros((M, 1), jnp.float32)
    if m_pad != M:
        xk, xs = (jnp.pad(a, ((0, m_pad - M), (0, 0))) for a in (xk, xs))
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    if grouped:
        grid, out = (m_pad // tm * (N // tn),), jax.ShapeDtypeStruct((m_pad, N), out_dtype)
    else:
        grid, out = (N // tn, m_pad // tm, split), jax.ShapeDtypeStruct((split, m_pad, N), jnp.float32)
    part = pl.pallas_call(
        functools.partial(_kernel, tk=tk, tn=tn, tm=tm, bk=bk, bn=bn, k_steps=K // (split * tk), act=act,
                          layout=layout, grouped=grouped),
        grid=grid, out_shape=out, compiler_params=compiler_params(warps, stages, interpret), interpret=interpret,
    )(layer, xk, xs, q, scale.astype(jnp.float32))
    return part[:M] if grouped else part.sum(axis=0)[:M].astype(out_dtype)
