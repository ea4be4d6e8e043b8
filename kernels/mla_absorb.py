"""The decode query's absorption through W_UK and its RoPE in one kernel, reading the query out of the
whole q projection and W_UK out of the layer-stacked kv_b_proj, both in place (Pallas, Triton backend).

    q [T, H, dn + dr]       (the q projection, before RoPE: q_nope = q[..., :dn], q_pe = q[..., dn:])
    kv_b [L, R, H, dn + dv] (W_UK = kv_b[layer, :, h, :dn])
    cos, sin [T, dr / 2]    (fp32, each token's rotation: models/layers.py rope_cos_sin)
        -> q_lat [T, H, R] = q_nope[t, h] . W_UK[h]^T,
           q_pe [T, H, dr]  = q_pe rotated pairwise (DeepSeek's interleaved layout, models/layers.py
                              apply_rope: y[2i] = x[2i] c - x[2i+1] s, y[2i+1] = x[2i] s + x[2i+1] c)

In XLA the same took three kernels a layer on an H200 at batch 32: a pad of q_nope with zeros (so the
GEMM could read kv_b's whole rows in place instead of copying W_UK's strided slice out), the GEMM, and
the RoPE, 1.9 + 3.8 + 1.3 us (benchmarks/RESULTS.md, session 9). XLA still copies q out of the fused
q / kv_a GEMM's output for the kernel (1.8 us).

Grid (H, R // block_r). Program (h, rb) multiplies the T tokens' q_nope of head h [T, dn] by the
[block_r, dn] tile of W_UK[h] (fp32 accumulation, one dot: dn is a single tile) and writes q_lat's
[T, block_r] tile in q's dtype, as XLA's GEMM rounds; the head's first program also rotates its q_pe
(even and odd lanes read and written with stride 2, fp32, rounded to q's dtype).

Three parts (ARCHITECTURE.md rule 6): `absorb_query` (the kernel; `interpret=True` runs it on the CPU)
and `absorb_query_reference` (pure JAX, the same sums up to fp32 summation order). Invariants: T is a
multiple of 16 (Triton's dot), dn and dr / 2 are powers of two, block_r divides R.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.kernels.mla_decode import EXACT

BLOCK_T = 16  # Triton's dot needs at least 16 rows


def supported(num_tokens: int, dn: int, dr: int, R: int, block_r: int = 64) -> bool:
    """Whether the kernel takes a step of `num_tokens` tokens with these head dims."""
    pow2 = lambda n: n >= 1 and n & (n - 1) == 0  # noqa: E731
    return num_tokens % BLOCK_T == 0 and dn >= 16 and pow2(dn) and dr % 2 == 0 and pow2(dr // 2) and (
        R % min(block_r, R) == 0)


def _absorb_kernel(layer_ref, q_ref, w_ref, cos_ref, sin_ref, lat_ref, pe_ref, *, dn, dr, block_r):
    h, rb = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(rb * block_r, block_r)
    q_nope = q_ref[:, h, pl.ds(0, dn)]  # [T, dn]
    w_uk = w_ref[layer_ref[0], cols, h, pl.ds(0, dn)].astype(q_nope.dtype)  # [br, dn]
    q_lat = jnp.dot(q_nope, w_uk.T, preferred_element_type=jnp.float32, precision=EXACT)  # [T, br]
    lat_ref[:, h, cols] = q_lat.astype(lat_ref.dtype)

    @pl.when(rb == 0)
    def _():
        even, odd = pl.ds(0, dr // 2, stride=2), pl.ds(1, dr // 2, stride=2)
        x0 = q_ref[:, h, pl.ds(dn, dr // 2, stride=2)].astype(jnp.float32)  # [T, dr/2]
        x1 = q_ref[:, h, pl.ds(dn + 1, dr // 2, stride=2)].astype(jnp.float32)
        c, s = cos_ref[...], sin_ref[...]
        pe_ref[:, h, even] = (x0 * c - x1 * s).astype(pe_ref.dtype)
        pe_ref[:, h, odd] = (x0 * s + x1 * c).astype(pe_ref.dtype)


@functools.partial(jax.jit, static_argnames=("dn", "block_r", "num_warps", "num_stages", "interpret"))
def absorb_query(q, kv_b, layer, cos, sin, *, dn, block_r=64, num_warps=4, num_stages=1, interpret=False):
    """q [T, H, dn + dr] (the unroped q projection), kv_b [L, R, H, dn + dv] stacked, layer: int32
    scalar, cos / sin [T, dr / 2] -> (q_lat [T, H, R], q_pe [T, H, dr] rotated), in q's dtype (the
    module docstring)."""
    T, H, W = q.shape
    _, R, H2, _ = kv_b.shape
    dr = W - dn
    block_r = min(block_r, R)
    assert H == H2 and cos.shape == sin.shape == (T, dr // 2) and supported(T, dn, dr, R, block_r), (
        q.shape, kv_b.shape, cos.shape, dn, block_r)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(
        functools.partial(_absorb_kernel, dn=dn, dr=dr, block_r=block_r),
        grid=(H, R // block_r),
        out_shape=(jax.ShapeDtypeStruct((T, H, R), q.dtype), jax.ShapeDtypeStruct((T, H, dr), q.dtype)),
        compiler_params=params, interpret=interpret,
    )(layer, q, kv_b, cos.astype(jnp.float32), sin.astype(jnp.float32))


def absorb_query_reference(q, kv_b, layer, cos, sin, *, dn):
    """Pure JAX: (q[..., :dn] . W_UK[layer]^T, q[..., dn:] rotated pairwise), in q's dtype."""
    w_uk = jax.lax.dynamic_index_in_dim(kv_b, layer, keepdims=False)[..., :dn].astype(q.dtype)  # [R, H, dn]
    q_lat = jnp.einsum("thd,rhd->thr", q[..., :dn], w_uk, preferred_element_type=jnp.float32, precision=EXACT)
    x = q[..., dn:].astype(jnp.float32)
    x0, x1, c, s = x[..., 0::2], x[..., 1::2], cos[:, None, :], sin[:, None, :]
    q_pe = jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(x.shape)
    return q_lat.astype(q.dtype), q_pe.astype(q.dtype)
