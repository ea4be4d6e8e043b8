"""A decode MoE layer's path from o_proj's split-K partials to the MoE's routing, in one launch (Pallas,
Triton backend):

    parts [S, T, D] fp32   o_proj's split-K partials (kernels/decode_matmul.py's, or kernels/mla_output.py's
                           launch), T a multiple of 16
    h [T, D]               the residual stream before the attention's output is added
    norm_w [L, D]          post_attention_layernorm, layer-stacked (row `layer` is used)
    gate [L, D, E]         the router's weight, layer-stacked
    bias [E] fp32 or None  noaux_tc's correction bias
        -> h_new [T, D] = h + round(sum_s parts[s])            (the layer's residual add)
           x [T, D]     = rms_norm(h_new, norm_w[layer])       (models/layers.py's arithmetic)
           and the routing of x's router logits: kernels/moe_route.py route_align's five outputs

XLA and the routing kernel ran this as six launches a layer: the partials' sum with the residual (1.8 us),
the RMSNorm (1.6), a split-K router GEMM (1.9) and its reduce (1.5), and moe_route's kernel (6.1; H200,
V2-Lite, batch 32, benchmarks/RESULTS.md session 11). Each costs 1.3-2 us however little it does.

Grid: T + C + R programs in three phases; each phase's programs wait on an atomic counter of the phase
before. A 1-D grid starts its programs in order, so every program of an earlier phase has started before
a later one waits: no deadlock.
1. Token t: its row of the partials summed (split order), rounded and added to the residual; the row's
   RMSNorm. Writes h_new[t] and x[t].
2. K chunk c of the router GEMM (C chunks): loads its [D / C, E] slice of the gate first (the weights do
   not wait), then waits for all T rows of x and multiplies them on the tensor cores: a [T, E] fp32
   partial of the logits.
3. Routing program r (moe_route's R row chunks): waits for the C partials, adds them (chunk order) and
   runs `moe_route.route_chunk`.
(The first try, session 10's kernels/residual_router.py, walked one token's row per program and formed
the router's products elementwise: 11.8 us. Here the GEMM is a [T, D] x [D, E] dot split over C programs.)

Three parts (ARCHITECTURE.md rule 6): `residual_route` (the kernel; `interpret=True` runs it on the CPU)
and `residual_route_reference` (pure JAX: the layer's arithmetic restated, as kernels do not import
models; a test ties it to the model's functions). Invariants: as `moe_route.route_align` (T, E powers of
two, T * (k + S) <= 2048), T >= 16, D divisible by C with D / C >= 16; under 16 experts (test models) the
router's products are summed elementwise instead of by a dot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.kernels import launch_sync
from deepinfer_jax.kernels.moe_gmm import EXACT
from deepinfer_jax.kernels.moe_route import padded_rows, route_align_reference, route_chunk
from deepinfer_jax.kernels.moe_route import supported as route_supported
from deepinfer_jax.kernels.triton_params import compiler_params

ROUTER_CHUNKS = 4  # C: the router GEMM's K chunks ([512, 64] gate slices at V2-Lite's D = 2048)


def supported(num_tokens: int, D: int, E: int, k: int, num_shared: int, chunks: int = ROUTER_CHUNKS) -> bool:
    """Whether the launch takes a step of `num_tokens` tokens with these sizes."""
    return route_supported(num_tokens, E, k, num_shared) and num_tokens >= 16 and D % chunks == 0 and D // chunks >= 16


def _kernel(layer_ref, parts_ref, h_ref, nw_ref, g_ref, *refs, T, C, eps, spin, has_bias, route_kw):
    refs = list(refs)
    bias_ref = refs.pop(0) if has_bias else None
    _cnt_in, hn_ref, x_ref, lp_ref, w_ref, idx_ref, row_of_ref, row_copy_ref, be_ref, cnt_ref = refs
    p, layer = pl.program_id(0), layer_ref[0]
    S, _, D = parts_ref.shape
    KC = D // C

    def release(i):
        launch_sync.release(cnt_ref, i, spin)

    def acquire(i, target):
        launch_sync.acquire(cnt_ref, i, target, spin)

    @pl.when(p < T)  # phase 1: token t's residual add and RMSNorm
    def _():
        t, hdt = p, hn_ref.dtype
        o = parts_ref[0, t, :]  # [D] fp32
        for s in range(1, S):
            o = o + parts_ref[s, t, :]
        hn = (h_ref[t, :].astype(jnp.float32) + o.astype(hdt).astype(jnp.float32)).astype(hdt)
        hf = hn.astype(jnp.float32)
        normed = (hf * jax.lax.rsqrt(jnp.sum(hf * hf) / D + eps)).astype(hdt)
        hn_ref[t, :] = hn
        x_ref[t, :] = (nw_ref[layer, :].astype(jnp.float32) * normed.astype(jnp.float32)).astype(x_ref.dtype)
        release(0)

    @pl.when((p >= T) & (p < T + C))  # phase 2: K chunk c of the router's logits
    def _():
        c = p - T
        cols = pl.ds(c * KC, KC)
        g = g_ref[layer, cols, :]  # [KC, E], loaded before the wait
        acquire(0, T)
        xk = x_ref[:, cols]  # [T, KC]
        if g.shape[1] < 16:  # fewer experts than Triton's dot takes (small test models): the same exact products
            lg = jnp.sum(xk.astype(jnp.float32)[:, :, None] * g.astype(jnp.float32)[None], axis=1)
        elif xk.dtype == g.dtype and xk.dtype != jnp.float32:  # 16-bit products, fp32 sums (moe.router_logits)
            lg = jnp.dot(xk, g, preferred_element_type=jnp.float32)
        else:
            lg = jnp.dot(xk.astype(jnp.float32), g.astype(jnp.float32), preferred_element_type=jnp.float32,
                         precision=EXACT)
        lp_ref[c] = lg
        release(1)

    @pl.when(p >= T + C)  # phase 3: the routing, one alignment row chunk a program
    def _():
        acquire(1, C)
        logits = lp_ref[0]
        for c in range(1, C):
            logits = logits + lp_ref[c]
        route_chunk(p - T - C, logits, bias_ref, w_ref, idx_ref, row_of_ref, row_copy_ref, be_ref, **route_kw)


@functools.partial(jax.jit, static_argnames=("eps", "k", "num_shared", "block_m", "scoring_func", "norm_topk_prob",
                                             "routed_scaling_factor", "chunks", "num_warps", "interpret"))
def residual_route(parts, h, norm_w, gate, layer, bias=None, *, eps, k, num_shared, block_m, scoring_func="softmax",
                   norm_topk_prob=False, routed_scaling_factor=1.0, chunks=ROUTER_CHUNKS, num_warps=8,
                   interpret=False):
    """The module docstring: -> (h_new [T, D] in h's dtype, x [T, D] in rms_norm's dtype, weights [T, K] fp32,
    idx [T, K] int32, row_copy [M], block_expert [M // block_m], row_of [T * K]); K = k + num_shared, the
    last four as `moe_route.route_align`'s. 8 warps: the routing's chain of reductions (moe_route's
    measured best)."""
    S, T, D = parts.shape
    _, D2, E = gate.shape
    assert D == D2 == h.shape[1] == norm_w.shape[1] and h.shape[0] == T and supported(T, D, E, k, num_shared, chunks), (
        parts.shape, h.shape, norm_w.shape, gate.shape)
    K, M = k + num_shared, padded_rows(T, k, num_shared, E, block_m)
    row_chunk = min(M, 128)
    route_kw = dict(k=k, S=num_shared, block_m=block_m, softmax=scoring_func == "softmax", norm=norm_topk_prob,
                    scale=float(routed_scaling_factor), row_chunk=row_chunk)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    x_dtype = jnp.promote_types(norm_w.dtype, h.dtype)
    params = compiler_params(num_warps, 1, interpret)
    args = (layer, parts, h, norm_w, gate, *(() if bias is None else (bias.astype(jnp.float32),)),
            jnp.zeros((2,), jnp.int32))  # the phases' counters
    out_shape = (jax.ShapeDtypeStruct((T, D), h.dtype), jax.ShapeDtypeStruct((T, D), x_dtype),
                 jax.ShapeDtypeStruct((chunks, T, E), jnp.float32), jax.ShapeDtypeStruct((T, K), jnp.float32),
                 jax.ShapeDtypeStruct((T, K), jnp.int32), jax.ShapeDtypeStruct((T, K), jnp.int32),
                 jax.ShapeDtypeStruct((M,), jnp.int32), jax.ShapeDtypeStruct((M // block_m,), jnp.int32),
                 jax.ShapeDtypeStruct((2,), jnp.int32))
    h_new, x, _, w, idx, row_of, row_copy, block_expert, _ = pl.pallas_call(
        functools.partial(_kernel, T=T, C=chunks, eps=float(eps), spin=not interpret, has_bias=bias is not None,
                          route_kw=route_kw),
        grid=(T + chunks + M // row_chunk,), out_shape=out_shape, input_output_aliases={len(args) - 1: 8},
        compiler_params=params, interpret=interpret,
    )(*args)
    return h_new, x, w, idx, row_copy, block_expert, row_of.reshape(-1)


def residual_route_reference(parts, h, norm_w, gate, layer, bias=None, *, eps, k, num_shared, block_m,
                             scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0):
    """Pure JAX, the layer's arithmetic restated: the residual add in h's dtype, rms_norm, the router's fp32
    logits (16-bit products summed in fp32) and `moe_route.route_align_reference`."""
    h_new = h + parts.sum(axis=0).astype(h.dtype)
    hf = h_new.astype(jnp.float32)
    normed = (hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps)).astype(h.dtype)
    x = jax.lax.dynamic_index_in_dim(norm_w, layer, keepdims=False) * normed
    g = jax.lax.dynamic_index_in_dim(gate, layer, keepdims=False)
    if x.dtype == g.dtype and x.dtype != jnp.float32:
        logits = jnp.einsum("td,de->te", x, g, preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("td,de->te", x.astype(jnp.float32), g.astype(jnp.float32), precision=EXACT)
    routed = route_align_reference(logits, bias, k=k, num_shared=num_shared, block_m=block_m,
                                   scoring_func=scoring_func, norm_topk_prob=norm_topk_prob,
                                   routed_scaling_factor=routed_scaling_factor)
    return (h_new, x, *routed)
