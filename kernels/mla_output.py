"""The decode attention's output in one kernel: merge the context splits, then apply W_UV, reading the
layer's kv_b_proj in place from its layer-stacked array (Pallas, Triton backend).

    o [T, nh, S, bh, R] fp32, m / l [T, nh, S, bh] fp32   (kernels/mla_decode.py's splits, H = nh * bh)
    kv_b [L, R, H, dn + dv]                                 (W_UV = kv_b[layer, :, h, dn:])
        -> out [T, H, dv] = merge(o, m, l)[t, h] . W_UV[h]

In XLA the same is five kernels a layer (the merge's two reductions, the copy of W_UV's slice out of
the stacked weights, a split-K GEMM and its reduce: 9.4 us on an H200 at batch 32; benchmarks/
RESULTS.md); this kernel takes 7.0 us alone and 9.2-10.1 us in the step, where it breaks even.

Grid (H, T // block_t, dv // block_v). Program (h, tb, vb) computes its block_t tokens' split weights
for head h once (exp(m_s - M) and the merged denominator), then walks the latent in block_r slices:
each slice of the S splits' accumulators is merged in fp32, rounded to `dtype` as the separate path
rounds the merged latent, and multiplied by the matching [block_r, block_v] tile of W_UV[h] (fp32
accumulation). Small slices keep the tiles in registers (the whole 512-wide latent of four splits
spilled: 38.7 us a layer on an H200). The merged latent is
recomputed by the dv // block_v programs of a head; those reads come from L2.

Three parts (ARCHITECTURE.md rule 6): `merge_value_projection` (the kernel; `interpret=True` runs it on the
CPU) and `merge_value_projection_reference` (pure JAX: `mla_decode.merge_splits`, the rounding, an einsum).
Invariants: T is a multiple of block_t (at least 16, Triton's dot), block_v divides dv and block_r R; a split with
l = 0 (past its sequence's pages) carries m = NEG and adds nothing; every token has at least one key, so
the merged denominator is positive.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.kernels.mla_decode import EXACT, merge_splits
from deepinfer_jax.kernels.triton_params import compiler_params

BLOCK_T = 16  # tokens a program merges: Triton's dot needs at least 16 rows


def supported(num_tokens: int, dv: int) -> bool:
    """Whether the kernel takes a step of `num_tokens` query tokens with value heads `dv` wide."""
    return num_tokens % BLOCK_T == 0 and dv % 16 == 0


def _merge_tile(h, tb, vb, layer, o_ref, m_ref, l_ref, w_ref, store, *, bh, splits, dn, block_t, block_v, block_r,
                dtype):
    """Program (h, tb, vb): tokens tb * block_t .. of head h, value columns vb * block_v ..; `store(rows, y)`
    writes the [block_t, block_v] result."""
    hb, hi = h // bh, h % bh
    rows = pl.ds(tb * block_t, block_t)
    ms = [m_ref[rows, hb, s, hi] for s in range(splits)]  # S x [bt]
    M = functools.reduce(jnp.maximum, ms)
    ws = [jnp.exp(m - M) for m in ms]  # empty splits: exp(NEG - M) = 0
    den = functools.reduce(jnp.add, [w * l_ref[rows, hb, s, hi] for s, w in enumerate(ws)])
    cols = pl.ds(dn + vb * block_v, block_v)

    def body(c, acc):  # one block_r slice of the latent: merged, rounded, times W_UV's rows
        ks = pl.ds(c * block_r, block_r)
        num = functools.reduce(jnp.add, [w[:, None] * o_ref[rows, hb, s, hi, ks] for s, w in enumerate(ws)])
        o_lat = (num / den[:, None]).astype(dtype)  # [bt, br]
        w_uv = w_ref[layer, ks, h, cols].astype(dtype)  # [br, bv]
        return acc + jnp.dot(o_lat, w_uv, preferred_element_type=jnp.float32, precision=EXACT)

    R = o_ref.shape[-1]
    y = jax.lax.fori_loop(0, R // block_r, body, jnp.zeros((block_t, block_v), jnp.float32))
    store(rows, y.astype(dtype))


def _mla_output_kernel(layer_ref, o_ref, m_ref, l_ref, w_ref, out_ref, *, block_v, **kw):
    h, tb, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    def store(rows, y):
        out_ref[rows, h, pl.ds(vb * block_v, block_v)] = y

    _merge_tile(h, tb, vb, layer_ref[0], o_ref, m_ref, l_ref, w_ref, store, block_v=block_v, **kw)


def merge_slice(splits: int) -> int:
    """Latent columns a program merges and multiplies a step (`block_r`) for `splits` context splits: 64 up to
    four splits, else 32, so that a step's merged slices stay at most 64 x 16 x 4 fp32 values (a thread's 32).
    In the batch-32 step (four splits) 64 beat 32 on an H200: 8.05, 8.05 ms a step against 8.07, 8.08,
    alternating (half the loop steps, so half the merge's barriers and layout changes: Nsight Compute found the
    kernel bound by its warps' issue latency). Steps of 16 tokens (8 splits) keep 32; 64 is not measured there."""
    return 64 if splits <= 4 else 32


@functools.partial(jax.jit, static_argnames=("dn", "dtype", "block_v", "block_r", "num_warps", "num_stages",
                                             "interpret"))
def merge_value_projection(o, m, l, kv_b, layer, *, dn, dtype, block_v=64, block_r=None, num_warps=4, num_stages=3,
                           interpret=False):
    """o [T, nh, S, bh, R], m / l [T, nh, S, bh] (fp32 splits), kv_b [L, R, H, dn + dv] stacked, layer:
    int32 scalar -> [T, H, dv] in `dtype` (the module docstring). block_r None: `merge_slice(S)`. Of nine tiles
    on an H200 alone at batch 32 with four splits, 64 x 32 was the fastest (7.0 us; 64 x 64: 8.0)."""
    T, nh, S, bh, R = o.shape
    _, R2, H, W = kv_b.shape
    dv = W - dn
    block_v, block_r = min(block_v, dv), min(block_r or merge_slice(S), R)
    assert R == R2 and H == nh * bh and T % BLOCK_T == 0 and dv % block_v == 0 and R % block_r == 0, (
        o.shape, kv_b.shape, dn, block_v, block_r)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    params = compiler_params(num_warps, num_stages, interpret)
    return pl.pallas_call(
        functools.partial(_mla_output_kernel, bh=bh, splits=S, dn=dn, block_t=BLOCK_T, block_v=block_v,
                          block_r=block_r, dtype=jnp.dtype(dtype)),
        grid=(H, T // BLOCK_T, dv // block_v), out_shape=jax.ShapeDtypeStruct((T, H, dv), dtype),
        compiler_params=params, interpret=interpret,
    )(layer, o, m, l, kv_b)


def merge_value_projection_reference(o, m, l, kv_b, layer, *, dn, dtype):
    """Pure JAX: merge the splits, round to `dtype`, multiply by W_UV[layer] -> [T, H, dv] in `dtype`."""
    o_lat = merge_splits(o, m, l).astype(dtype)  # [T, H, R]
    w_uv = jax.lax.dynamic_index_in_dim(kv_b, layer, keepdims=False)[..., dn:].astype(dtype)  # [R, H, dv]
    return jnp.einsum("thr,rhv->thv", o_lat, w_uv, preferred_element_type=jnp.float32,
                      precision=EXACT).astype(dtype)
