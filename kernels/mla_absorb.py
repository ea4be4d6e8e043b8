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
the RoPE, 1.9 + 3.8 + 1.3 us (benchmarks/RESULTS.md). Where XLA merged the q / kv_a GEMMs
itself, it copied q out of their output for the kernel (1.8 us); the kernel reads that output in place
(ckv None, below).

Grid (H, R // block_r). Program (h, rb) multiplies the T tokens' q_nope of head h [T, dn] by the
[block_r, dn] tile of W_UK[h] (fp32 accumulation, one dot: dn is a single tile) and writes q_lat's
[T, block_r] tile in q's dtype, as XLA's GEMM rounds; the head's first program also rotates its q_pe
(even and odd lanes read and written with stride 2, fp32, rounded to q's dtype).

`absorb_query_write_latents` is the same launch doing the step's latents too, which XLA ran as three
more kernels a layer (kv_a_layernorm's RMSNorm with the k_pe RoPE, the paged cache's scatter and a slice
copy: 1.6 + 3.0 + 1.3 us, same step). Grid (T + H * R // block_r,): programs [0, T) take token t's raw kv_a
row ckv [R + dr], RMSNorm its first R values (models/layers.py rms_norm's arithmetic: fp32, rounded to
ckv's dtype, times the weight), rotate its last dr (as q_pe, stride-2 lanes), cast to the cache's dtype
and store it at cache[cache_layer, slot // page_size, slot % page_size]; the other programs are
`absorb_query`'s (h, rb), in row-major order. The cache goes in as an operand aliased to the third output
(written in place, only the T slots); tokens sharing a slot (padding tokens in the null page, which no
query attends) race, as in XLA's scatter: one of them wins. With ckv None, q is the merged q / kv_a projection
[T, H * (dn + dr) + R + dr], one GEMM's output passed as both operands: the absorb programs read head h's q from
columns [h * (dn + dr), (h + 1) * (dn + dr)), the latent programs their kv_a row from the columns after them, so
no slice of it is copied out first (RunnerConfig.decode_merged_qkv).

Three parts (ARCHITECTURE.md rule 6): `absorb_query` / `absorb_query_write_latents` (the kernels;
`interpret=True` runs them on the CPU) and `absorb_query_reference` / `absorb_query_write_latents_reference`
(pure JAX, the same sums up to fp32 summation order; the latents bit for bit in a jitted step on the CPU).
Invariants: T is a multiple of 16 (Triton's dot), dn and dr / 2 are powers of two, block_r divides R; with
the latents, R is a power of two too (one row in a Triton tensor) and every slot is >= 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.kernels.mla_decode import EXACT
from deepinfer_jax.kernels.triton_params import compiler_params

E4M3_MAX = 448.0


def to_cache(v, dtype):
    """v as the cache stores it: a cast, saturating at e4m3's +-448 for an FP8 cache (models/cache.py
    `to_cache_dtype`'s arithmetic: e4m3fn has no infinity, an out-of-range value would become NaN)."""
    if jnp.dtype(dtype) == jnp.float8_e4m3fn:
        v = jnp.clip(v, -E4M3_MAX, E4M3_MAX)
    return v.astype(dtype)

BLOCK_T = 16  # Triton's dot needs at least 16 rows


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def supported(num_tokens: int, dn: int, dr: int, R: int, block_r: int = 64) -> bool:
    """Whether the kernel takes a step of `num_tokens` tokens with these head dims."""
    return num_tokens % BLOCK_T == 0 and dn >= 16 and _pow2(dn) and dr % 2 == 0 and _pow2(dr // 2) and (
        R % min(block_r, R) == 0)


def latent_supported(num_tokens: int, dn: int, dr: int, R: int, block_r: int = 64) -> bool:
    """Whether `absorb_query_write_latents` takes these sizes: `supported`'s, and a latent row of R values
    that Triton can hold (a power of two)."""
    return supported(num_tokens, dn, dr, R, block_r) and _pow2(R)


def cols(start, size, stride=1):
    """pl.ds(start, size), strided where stride > 1."""
    return pl.ds(start, size) if stride == 1 else pl.ds(start, size, stride=stride)


def absorb_tile(h, rb, layer, load_q, w_ref, cos_ref, sin_ref, lat_ref, pe_ref, *, dn, dr, block_r):
    """Program (h, rb) of the absorption: q_lat's [T, block_r] tile of head h; with rb == 0 also q_pe of h.
    `load_q(h, start, size, stride)`: the T tokens' q[:, h, cols(start, size, stride)] in q's dtype."""
    cs = pl.ds(rb * block_r, block_r)
    q_nope = load_q(h, 0, dn, 1)  # [T, dn]
    w_uk = w_ref[layer, cs, h, pl.ds(0, dn)].astype(q_nope.dtype)  # [br, dn]
    q_lat = jnp.dot(q_nope, w_uk.T, preferred_element_type=jnp.float32, precision=EXACT)  # [T, br]
    lat_ref[:, h, cs] = q_lat.astype(lat_ref.dtype)

    @pl.when(rb == 0)
    def _():
        even, odd = pl.ds(0, dr // 2, stride=2), pl.ds(1, dr // 2, stride=2)
        x0 = load_q(h, dn, dr // 2, 2).astype(jnp.float32)  # [T, dr/2]
        x1 = load_q(h, dn + 1, dr // 2, 2).astype(jnp.float32)
        c, s = cos_ref[...], sin_ref[...]
        pe_ref[:, h, even] = (x0 * c - x1 * s).astype(pe_ref.dtype)
        pe_ref[:, h, odd] = (x0 * s + x1 * c).astype(pe_ref.dtype)


def _q_loader(q_ref, width=None):
    """`absorb_tile`'s load_q for a q operand [T, H, dn + dr], or with `width` (dn + dr) for the merged q / kv_a
    projection [T, H * width + R + dr], whose head h is columns [h * width, (h + 1) * width)."""
    if width is None:
        return lambda h, start, size, stride: q_ref[:, h, cols(start, size, stride)]
    return lambda h, start, size, stride: q_ref[:, cols(h * width + start, size, stride)]


def _absorb_kernel(layer_ref, q_ref, w_ref, cos_ref, sin_ref, lat_ref, pe_ref, *, dn, dr, block_r):
    absorb_tile(pl.program_id(0), pl.program_id(1), layer_ref[0], _q_loader(q_ref), w_ref, cos_ref,
                sin_ref, lat_ref, pe_ref, dn=dn, dr=dr, block_r=block_r)


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
    params = compiler_params(num_warps, num_stages, interpret)
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


def latent_row(t, slot_ref, load_ckv, norm_ref, layer, cos_ref, sin_ref, cache_layer, cache_ref, *, R, dr, eps):
    """Token t's latent: RMSNorm of ckv[t, :R] (models/layers.py rms_norm's arithmetic), RoPE of
    ckv[t, R:] (apply_rope's), cast to the cache's dtype and stored at its slot of layer `cache_layer`.
    `load_ckv(t, start, size, stride)`: ckv[t, cols(start, size, stride)] in the activations' dtype."""
    page_size = cache_ref.shape[2]
    slot = slot_ref[t]
    page, offset = jax.lax.div(slot, page_size), jax.lax.rem(slot, page_size)  # slots are >= 0
    x = load_ckv(t, 0, R, 1)  # [R], the activations' dtype
    xf = x.astype(jnp.float32)
    normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf) + eps)).astype(x.dtype)
    w = norm_ref[layer, pl.ds(0, R)]  # [R]
    c_kv = (w.astype(jnp.float32) * normed.astype(jnp.float32)).astype(jnp.promote_types(w.dtype, x.dtype))
    cache_ref[cache_layer, page, offset, pl.ds(0, R)] = to_cache(c_kv, cache_ref.dtype)
    x0 = load_ckv(t, R, dr // 2, 2).astype(jnp.float32)  # [dr/2]
    x1 = load_ckv(t, R + 1, dr // 2, 2).astype(jnp.float32)
    c, s = cos_ref[t, :], sin_ref[t, :]
    for lane, y in ((0, x0 * c - x1 * s), (1, x0 * s + x1 * c)):  # k_pe in x's dtype, then the cache's
        cache_ref[cache_layer, page, offset, pl.ds(R + lane, dr // 2, stride=2)] = to_cache(
            y.astype(x.dtype), cache_ref.dtype)


def _absorb_latent_kernel(layer_ref, cache_layer_ref, slot_ref, q_ref, w_ref, cos_ref, sin_ref, ckv_ref, norm_ref,
                          _cache_in, lat_ref, pe_ref, cache_ref, *, dn, dr, block_r, eps, merged):
    T, R = ckv_ref.shape[0], cache_ref.shape[3] - dr
    H, nrb = w_ref.shape[2], w_ref.shape[1] // block_r
    pid = pl.program_id(0)
    layer = layer_ref[0]
    off = H * (dn + dr) if merged else 0  # where the kv_a rows start in ckv's columns

    @pl.when(pid < T)  # programs [0, T): token pid's latent into the cache
    def _():
        latent_row(pid, slot_ref, lambda t, start, *c: ckv_ref[t, cols(off + start, *c)], norm_ref, layer, cos_ref,
                   sin_ref, cache_layer_ref[0], cache_ref, R=R, dr=dr, eps=eps)

    @pl.when(pid >= T)  # programs [T, T + H * nrb): the absorption's (h, rb) tiles
    def _():
        p = pid - T
        absorb_tile(p // nrb, p % nrb, layer, _q_loader(q_ref, (dn + dr) if merged else None), w_ref, cos_ref,
                    sin_ref, lat_ref, pe_ref, dn=dn, dr=dr, block_r=block_r)


@functools.partial(jax.jit, static_argnames=("dn", "eps", "block_r", "num_warps", "num_stages", "interpret"))
def absorb_query_write_latents(q, kv_b, layer, cos, sin, ckv, norm_w, cache, cache_layer, slots, *, dn, eps,
                               block_r=64, num_warps=4, num_stages=1, interpret=False):
    """`absorb_query`, and in the same kernel launch this step's latents written into the paged cache.

    q [T, H, dn + dr], kv_b [L, R, H, dn + dv], layer, cos / sin [T, dr / 2]: as `absorb_query`.
    ckv [T, R + dr]      the kv_a projection's rows, before the norm and RoPE (activations' dtype); or None, with
                         q the merged q / kv_a projection [T, H * (dn + dr) + R + dr] (`models/mla.py:
                         project_qkv_merged`): both read in place from its columns, no slice copied out
    norm_w [L, R]        kv_a_layernorm, layer-stacked like kv_b (row `layer` is used)
    cache [Lc, P, page_size, R + dr], cache_layer: int32 scalar; slots [T] int32, each >= 0 (page * page_size +
        offset; padding tokens: slots of the null page, as models/cache.py StepMetadata.slot_mapping)
        -> (q_lat [T, H, R], q_pe [T, H, dr], cache), cache updated in place (aliased to the output):
           cache[cache_layer, slot // page_size, slot % page_size] =
               concat(rms_norm(ckv[t, :R], norm_w[layer], eps), rope(ckv[t, R:]))  for each token t,
           nothing else changes. Tokens sharing a slot (padding tokens, when T > page_size) race: one wins.

    Grid (T + H * R // block_r,): programs [0, T) norm, rotate and store one token's latent each; the rest
    are `absorb_query`'s (h, rb) programs in row-major order."""
    _, R, H, _ = kv_b.shape
    T, dr = q.shape[0], 2 * cos.shape[-1]
    merged = ckv is None
    if merged:  # one operand, passed twice (the same buffer): the q programs and the latent programs read their columns
        assert q.shape == (T, H * (dn + dr) + R + dr), (q.shape, kv_b.shape, dn, dr)
        ckv = q
    else:
        assert q.shape == (T, H, dn + dr) and ckv.shape == (T, R + dr), (q.shape, ckv.shape, kv_b.shape, dn, dr)
    block_r = min(block_r, R)
    assert cos.shape == sin.shape == (T, dr // 2) and latent_supported(T, dn, dr, R, block_r), (
        q.shape, kv_b.shape, cos.shape, dn, block_r)
    assert norm_w.shape == (kv_b.shape[0], R) and cache.shape[3] == R + dr and slots.shape == (T,), (
        norm_w.shape, cache.shape, slots.shape)
    layer, cache_layer = (jnp.asarray(i, jnp.int32).reshape(1) for i in (layer, cache_layer))
    params = compiler_params(num_warps, num_stages, interpret)
    return pl.pallas_call(
        functools.partial(_absorb_latent_kernel, dn=dn, dr=dr, block_r=block_r, eps=float(eps), merged=merged),
        grid=(T + H * (R // block_r),),
        out_shape=(jax.ShapeDtypeStruct((T, H, R), q.dtype), jax.ShapeDtypeStruct((T, H, dr), q.dtype),
                   jax.ShapeDtypeStruct(cache.shape, cache.dtype)),
        input_output_aliases={9: 2},  # the cache (operand 9) is output 2: written in place
        compiler_params=params, interpret=interpret,
    )(layer, cache_layer, slots.astype(jnp.int32), q, kv_b, cos.astype(jnp.float32), sin.astype(jnp.float32), ckv,
      norm_w, cache)


def latents_reference(ckv, norm_w, cos, sin, *, eps):
    """Pure JAX: ckv [T, R + dr] -> [T, R + dr], rms_norm(ckv[:, :R], norm_w [R]) and ckv[:, R:] rotated pairwise,
    concatenated (models/layers.py's rms_norm and apply_rope, restated: kernels do not import models; a test
    ties them). The first part in the promoted dtype of (norm_w, ckv), the second in ckv's."""
    R = norm_w.shape[-1]
    xf = ckv[:, :R].astype(jnp.float32)
    normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(ckv.dtype)
    x = ckv[:, R:].astype(jnp.float32)
    x0, x1 = x[:, 0::2], x[:, 1::2]
    k_pe = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(x.shape).astype(ckv.dtype)
    return jnp.concatenate([norm_w * normed, k_pe], axis=-1)


def absorb_query_write_latents_reference(q, kv_b, layer, cos, sin, ckv, norm_w, cache, cache_layer, slots, *, dn,
                                         eps):
    """Pure JAX: `absorb_query_reference`, and `latents_reference` (norm_w's row `layer`) cast to the cache's
    dtype and scattered into cache[cache_layer] at `slots` (models/deepseek.py write_latents). ckv None: q is
    the merged projection, as in `absorb_query_write_latents`."""
    if ckv is None:
        H, dr = kv_b.shape[2], 2 * cos.shape[-1]
        q, ckv = q[:, :H * (dn + dr)].reshape(q.shape[0], H, dn + dr), q[:, H * (dn + dr):]
    q_lat, q_pe = absorb_query_reference(q, kv_b, layer, cos, sin, dn=dn)
    latent = to_cache(latents_reference(ckv, norm_w[layer], cos, sin, eps=eps), cache.dtype)
    page_size = cache.shape[2]
    return q_lat, q_pe, cache.at[cache_layer, slots // page_size, slots % page_size].set(latent)
