"""The decode step's q and kv_a projections, the query's absorption and the latents' cache write in one
launch (Pallas, Triton backend): kernels/mla_absorb.py's `absorb_query_write_latents` with the two
projections' GEMM in front of it, both weights read in place from their layer-stacked arrays.

    x [T, D]                    the input RMSNorm's output (activations' dtype)
    w_q [L, D, H, dn + dr]      q_proj, layer-stacked (models without q-LoRA)
    w_kv [L, D, R + dr]         kv_a_proj_with_mqa, layer-stacked
    layer, kv_b, cos, sin, norm_w, cache, cache_layer, slots: as absorb_query_write_latents
        -> (q_lat [T, H, R], q_pe [T, H, dr], cache): absorb_query_write_latents(q, ..., ckv, ...) with
           q = x @ w_q[layer] and ckv = x @ w_kv[layer], each rounded to x's dtype (as the model's einsums)

Why: XLA ran the two projections as one split-K GEMM (7.4 us a layer on an H200 at batch 32), then copied q
and the raw latents out of its output for the absorb kernel (1.7 + 1.3 us), whose launch took 4.2 us
(benchmarks/RESULTS.md, session 11): 14.6 us for 15 MB of weights, about 3.5 us of bandwidth.

Grid (G + T + H * R // block_r,), in this order (kernels/launch_sync.py: the counters, and why the order
is deadlock-free):
- programs [0, G): the GEMM's (column tile n, K chunk s), n-major, over the N = H * (dn + dr) + R + dr
  columns of [x @ w_q | x @ w_kv]. Each multiplies x's K chunk by its weight tile (fp32 accumulation),
  stores its fp32 partial [T, block_n] in an internal [split_k, T, N] buffer and adds 1 to its group's
  counter: group h holds head h's dn + dr columns, group H the latent's R + dr;
- programs [G, G + T): token t's latent (`mla_absorb.latent_row`), once group H is complete;
- the rest: the absorption's (h, rb) tiles (`mla_absorb.absorb_tile`), once group h is complete.
A consumer adds up the split_k partials of the columns it reads (s = 0, 1, .. in order) and rounds the sum to
x's dtype, as XLA's GEMM rounds its output, then does absorb_query_write_latents' arithmetic.

Three parts (ARCHITECTURE.md rule 6): `project_absorb_write_latents` (the kernel; `interpret=True` runs it on
the CPU) and `project_absorb_write_latents_reference` (pure JAX: the two GEMMs, then
`absorb_query_write_latents_reference`; the same up to fp32 summation order, bit for bit where the GEMMs'
sums are exact). Invariants: absorb_query_write_latents'; block_n divides dn + dr and R + dr (a tile lies in
one group), split_k * block_k divides D.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.kernels import launch_sync
from deepinfer_jax.kernels.decode_matmul import fewest_chunks, largest_pow2_divisor
from deepinfer_jax.kernels.mla_absorb import (absorb_query_write_latents_reference, absorb_tile, cols, latent_row,
                                              latent_supported)
from deepinfer_jax.kernels.mla_decode import EXACT
from deepinfer_jax.kernels.triton_params import compiler_params


def plan(D: int, H: int, W: int, Wkv: int, interpret: bool = False) -> tuple[int, int, int] | None:
    """(block_n, block_k, split_k) for x [T, D] against [w_q | w_kv] (H heads W = dn + dr wide, Wkv = R + dr):
    column tiles that each lie in one head or in the latent, 64-deep K steps, and about 128 GEMM programs
    (decode_matmul's target). None where a tile would be under 16 wide or deep (Triton's dot; interpret mode
    takes any)."""
    block_n = largest_pow2_divisor(math.gcd(W, Wkv), 128)
    block_k = largest_pow2_divisor(D, 64)
    if min(block_n, block_k) < (1 if interpret else 16):
        return None
    return block_n, block_k, fewest_chunks((H * W + Wkv) // block_n, D // block_k)


def supported(num_tokens: int, D: int, H: int, dn: int, dr: int, R: int, interpret: bool = False) -> bool:
    """Whether the launch takes a step of `num_tokens` tokens at these sizes."""
    return latent_supported(num_tokens, dn, dr, R) and plan(D, H, dn + dr, R + dr, interpret) is not None


def _kernel(layer_ref, cache_layer_ref, slot_ref, x_ref, wq_ref, wkv_ref, kvb_ref, cos_ref, sin_ref, norm_ref,
            _cache_in, _cnt_in, lat_ref, pe_ref, cache_ref, part_ref, cnt_ref, *, H, dn, dr, block_n, block_k,
            split_k, block_r, eps, spin):
    p, layer = pl.program_id(0), layer_ref[0]
    T, D = x_ref.shape
    W, Wkv = dn + dr, wkv_ref.shape[2]
    R, Nq, nrb = Wkv - dr, H * W, kvb_ref.shape[1] // block_r
    q_tiles, G = Nq // block_n, (Nq + Wkv) // block_n * split_k
    k_steps, dtype = D // (split_k * block_k), x_ref.dtype

    def gemm(w_ref, n, s, col, group):  # weight column tile n, K chunk s -> part[s, :, col:col + block_n]
        cs = pl.ds(n * block_n, block_n)

        def body(i, acc):
            ks = pl.ds((s * k_steps + i) * block_k, block_k)
            return acc + jnp.dot(x_ref[:, ks], w_ref[layer, ks, cs].astype(dtype), preferred_element_type=jnp.float32,
                                 precision=EXACT)

        part_ref[s, :, pl.ds(col, block_n)] = jax.lax.fori_loop(0, k_steps, body, jnp.zeros((T, block_n), jnp.float32))
        launch_sync.release(cnt_ref, group, spin)

    def summed(rows, start, size, stride):  # the GEMM's output [rows, cols(start, size, stride)] in x's dtype
        c = cols(start, size, stride)  # a loop, not a Python sum: all split_k tiles live at once took 255 registers
        zero = jnp.zeros((T, size) if isinstance(rows, slice) else (size,), jnp.float32)
        return jax.lax.fori_loop(0, split_k, lambda s, acc: acc + part_ref[s, rows, c], zero).astype(dtype)

    @pl.when(p < G)
    def _():
        n, s = p // split_k, p % split_k

        @pl.when(n < q_tiles)
        def _():
            gemm(wq_ref, n, s, n * block_n, n * block_n // W)

        @pl.when(n >= q_tiles)
        def _():
            gemm(wkv_ref, n - q_tiles, s, n * block_n, H)

    @pl.when((p >= G) & (p < G + T))  # token p - G's latent into the cache
    def _():
        launch_sync.acquire(cnt_ref, H, Wkv // block_n * split_k, spin)
        latent_row(p - G, slot_ref, lambda t, start, size, stride: summed(t, Nq + start, size, stride), norm_ref,
                   layer, cos_ref, sin_ref, cache_layer_ref[0], cache_ref, R=R, dr=dr, eps=eps)

    @pl.when(p >= G + T)  # the absorption's (h, rb) tiles, h-major
    def _():
        h, rb = (p - G - T) // nrb, (p - G - T) % nrb
        launch_sync.acquire(cnt_ref, h, W // block_n * split_k, spin)
        absorb_tile(h, rb, layer, lambda h, start, size, stride: summed(slice(None), h * W + start, size, stride),
                    kvb_ref, cos_ref, sin_ref, lat_ref, pe_ref, dn=dn, dr=dr, block_r=block_r)


@functools.partial(jax.jit, static_argnames=("dn", "eps", "block_r", "block_n", "block_k", "split_k", "num_warps",
                                             "num_stages", "interpret"))
def project_absorb_write_latents(x, w_q, w_kv, layer, kv_b, cos, sin, norm_w, cache, cache_layer, slots, *, dn, eps,
                                 block_r=64, block_n=None, block_k=None, split_k=None, num_warps=4, num_stages=4,
                                 interpret=False):
    """The module docstring's launch: -> (q_lat [T, H, R], q_pe [T, H, dr], cache), the cache updated in place
    (aliased to the output) at this step's `slots` of layer `cache_layer` only. Tiles left as None come from
    `plan`; split_k must divide D // block_k."""
    T, D = x.shape
    L, R, H, _ = kv_b.shape
    Wkv = w_kv.shape[2]
    dr = Wkv - R
    W = dn + dr
    w_q = w_q.reshape(w_q.shape[0], D, H * W)  # heads flattened: a bitcast
    auto = plan(D, H, W, Wkv, interpret)
    assert auto is not None and supported(T, D, H, dn, dr, R, interpret), (x.shape, w_q.shape, w_kv.shape, kv_b.shape)
    block_n, block_k, split_k = (a if v is None else v for v, a in zip((block_n, block_k, split_k), auto))
    block_r = min(block_r, R)
    assert w_q.shape[0] == w_kv.shape[0] == L and w_kv.shape[1] == D and W % block_n == 0 and Wkv % block_n == 0 and (
        D % (split_k * block_k) == 0), (w_q.shape, w_kv.shape, block_n, block_k, split_k)
    assert cos.shape == sin.shape == (T, dr // 2) and norm_w.shape == (L, R) and cache.shape[3] == Wkv and (
        slots.shape == (T,)), (cos.shape, norm_w.shape, cache.shape, slots.shape)
    G = (H * W + Wkv) // block_n * split_k
    layer, cache_layer = (jnp.asarray(i, jnp.int32).reshape(1) for i in (layer, cache_layer))
    stages = num_stages if w_q.dtype.itemsize < 4 else 1  # fp32 tiles: one stage fits in shared memory
    params = compiler_params(num_warps, stages, interpret)
    args = (layer, cache_layer, slots.astype(jnp.int32), x, w_q, w_kv, kv_b, cos.astype(jnp.float32),
            sin.astype(jnp.float32), norm_w, cache, jnp.zeros((H + 1,), jnp.int32))  # the groups' counters
    q_lat, q_pe, cache, _, _ = pl.pallas_call(
        functools.partial(_kernel, H=H, dn=dn, dr=dr, block_n=block_n, block_k=block_k, split_k=split_k,
                          block_r=block_r, eps=float(eps), spin=not interpret),
        grid=(G + T + H * (R // block_r),),
        out_shape=(jax.ShapeDtypeStruct((T, H, R), x.dtype), jax.ShapeDtypeStruct((T, H, dr), x.dtype),
                   jax.ShapeDtypeStruct(cache.shape, cache.dtype),
                   jax.ShapeDtypeStruct((split_k, T, H * W + Wkv), jnp.float32),
                   jax.ShapeDtypeStruct((H + 1,), jnp.int32)),
        input_output_aliases={10: 2, 11: 4},  # the cache and the counters: written in place
        compiler_params=params, interpret=interpret,
    )(*args)
    return q_lat, q_pe, cache


def project_absorb_write_latents_reference(x, w_q, w_kv, layer, kv_b, cos, sin, norm_w, cache, cache_layer, slots, *,
                                           dn, eps):
    """Pure JAX: q = x @ w_q[layer] and ckv = x @ w_kv[layer] rounded to x's dtype, then
    `absorb_query_write_latents_reference`."""
    def project(w):  # x [T, D] @ w[layer] [D, ...] -> [T, ...] in x's dtype
        wl = jax.lax.dynamic_index_in_dim(w, layer, keepdims=False).astype(x.dtype)
        return jnp.tensordot(x, wl, axes=1, precision=EXACT, preferred_element_type=jnp.float32).astype(x.dtype)

    return absorb_query_write_latents_reference(project(w_q), kv_b, layer, cos, sin, project(w_kv), norm_w, cache,
                                                cache_layer, slots, dn=dn, eps=eps)
