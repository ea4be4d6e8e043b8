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
V2-Lite, batch 32, benchmarks/RESULTS.md). Each costs 1.3-2 us however little it does.

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
(A kernel that walked one token's row per program and formed the router's products elementwise took 11.8 us,
slower than XLA. Here the GEMM is a [T, D] x [D, E] dot split over C programs.)

Three parts (ARCHITECTURE.md rule 6): `residual_route` (the kernel; `interpret=True` runs it on the CPU) and
`residual_route_reference` (pure JAX: the layer's arithmetic restated, as kernels do not import models; tests
tie it to the model's functions). kernels/route_experts.py runs the same programs (`route_programs`) ahead of
the expert tiles. Invariants: as `moe_route.route_align` (T, E powers of two, T * (k + S) <= 2048), T >= 16, D
divisible by C with D / C >= 16; under 16 experts (test models) the router's products are summed
elementwise instead of by a dot.
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

ROUTER_CHUNKS = 4  # C: the router GEMM's K chunks ([512, 64] gate slices at V2-Lite's D = 2048), at least
# A router chunk's program holds its [T, D / C] slice of x and [D / C, E] slice of the gate in shared memory (an
# H200 SM has 227 KiB). At 256 bf16 tokens and 4 chunks that is 320 KiB: the launch failed to compile
# (benchmarks/moe_launch_sweep.py --batch 256), as would fp32 from 64 tokens. The model runs the launch
# up to decode_matmul.MAX_TOKENS (64) tokens, in bf16, where 4 chunks fit.
ROUTER_SMEM = 200 * 1024


def router_chunks(T: int, D: int, E: int, x_bytes: int = 2, gate_bytes: int = 2) -> int:
    """C for T tokens: ROUTER_CHUNKS, doubled while a chunk's slices of x and the gate ((T * x_bytes + E *
    gate_bytes) * D / C bytes) exceed ROUTER_SMEM and D / 2C is still a whole number of at least 16. V2-Lite
    (D 2048, 64 experts, bf16): 4 up to 128 tokens (192 KiB), 8 at 256."""
    c = ROUTER_CHUNKS
    while (T * x_bytes + E * gate_bytes) * (D // c) > ROUTER_SMEM and D % (2 * c) == 0 and D // (2 * c) >= 16:
        c *= 2
    return c


def supported(num_tokens: int, D: int, E: int, k: int, num_shared: int, chunks: int | None = None) -> bool:
    """Whether the launch takes a step of `num_tokens` tokens with these sizes (chunks None: `router_chunks`, bf16)."""
    chunks = chunks or router_chunks(num_tokens, D, E)
    fits = (2 * num_tokens + 2 * E) * (D // chunks) <= ROUTER_SMEM
    return (route_supported(num_tokens, E, k, num_shared) and num_tokens >= 16 and D % chunks == 0
            and D // chunks >= 16 and fits)


def _add_norm_row(t, layer, o, h_ref, nw_ref, hn_ref, x_ref, eps):
    """Token t: o [D] fp32 rounded to h's dtype and added to the residual (h_new[t]); x[t] = that row's
    RMSNorm times norm_w[layer] (models/layers.py rms_norm's arithmetic)."""
    D, hdt = o.shape[0], hn_ref.dtype
    hn = (h_ref[t, :].astype(jnp.float32) + o.astype(hdt).astype(jnp.float32)).astype(hdt)
    hf = hn.astype(jnp.float32)
    normed = (hf * jax.lax.rsqrt(jnp.sum(hf * hf) / D + eps)).astype(hdt)
    hn_ref[t, :] = hn
    x_ref[t, :] = (nw_ref[layer, :].astype(jnp.float32) * normed.astype(jnp.float32)).astype(x_ref.dtype)


def _pow2(n: int) -> bool:
    return n & (n - 1) == 0


def _partials_add_norm_row(t, layer, parts_ref, h_ref, nw_ref, hn_ref, x_ref, eps):
    """Token t's row of the partials summed, then `_add_norm_row`. A power-of-two count of partials is loaded
    as one [S, D] block (all loads in flight at once) and reduced as a tree; others one row at a time."""
    S = parts_ref.shape[0]
    if _pow2(S):
        o = jnp.sum(parts_ref[:, t, :], axis=0)  # [D] fp32
    else:
        o = parts_ref[0, t, :]
        for s in range(1, S):
            o = o + parts_ref[s, t, :]
    _add_norm_row(t, layer, o, h_ref, nw_ref, hn_ref, x_ref, eps)


def route_programs(p, layer, parts_ref, h_ref, nw_ref, g_ref, hn_ref, x_ref, lp_ref, cnt_ref, route, *, T, C, R, eps,
                   spin, routed_counter=None):
    """Programs 0 .. T + C + R - 1 of a launch: the module docstring's three phases (counters 0 and 1 of
    cnt_ref), phase 3 as `route(r, logits [T, E] fp32)` for routing program r (`route_chunk` with its output
    refs). With `routed_counter`, each routing program adds 1 to that counter once its outputs are stored, for
    later programs of the launch that wait on the routing (kernels/route_experts.py)."""
    D = parts_ref.shape[2]
    KC = D // C

    def release(i):
        launch_sync.release(cnt_ref, i, spin)

    def acquire(i, target):
        launch_sync.acquire(cnt_ref, i, target, spin)

    @pl.when(p < T)  # phase 1: token t's residual add and RMSNorm
    def _():
        _partials_add_norm_row(p, layer, parts_ref, h_ref, nw_ref, hn_ref, x_ref, eps)
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

    @pl.when((p >= T + C) & (p < T + C + R))  # phase 3: the routing, one alignment row chunk a program
    def _():
        acquire(1, C)
        logits = lp_ref[0]
        for c in range(1, C):
            logits = logits + lp_ref[c]
        route(p - T - C, logits)
        if routed_counter is not None:
            release(routed_counter)


def _kernel(layer_ref, parts_ref, h_ref, nw_ref, g_ref, *refs, T, C, R, eps, spin, has_bias, route_kw):
    refs = list(refs)
    bias_ref = refs.pop(0) if has_bias else None
    _cnt_in, hn_ref, x_ref, lp_ref, *route_refs, cnt_ref = refs
    route_programs(pl.program_id(0), layer_ref[0], parts_ref, h_ref, nw_ref, g_ref, hn_ref, x_ref, lp_ref,
                   cnt_ref, lambda r, logits: route_chunk(r, logits, bias_ref, *route_refs, **route_kw), T=T, C=C,
                   R=R, eps=eps, spin=spin)


def route_kwargs(T: int, E: int, k: int, num_shared: int, block_m: int, scoring_func: str, norm_topk_prob: bool,
                 routed_scaling_factor: float, shared_apart: bool = False) -> tuple[int, int, dict]:
    """(M, R, route_chunk's keywords) of a launch that routes T tokens: M aligned rows (the shared experts' groups
    among them unless `shared_apart`, where they start at row M), R routing programs of min(M, 128) rows each."""
    M = padded_rows(T, k, 0 if shared_apart else num_shared, E, block_m)
    row_chunk = min(M, 128)
    kw = dict(k=k, S=num_shared, block_m=block_m, softmax=scoring_func == "softmax", norm=norm_topk_prob,
              scale=float(routed_scaling_factor), row_chunk=row_chunk, shared_base=M if shared_apart else None)
    return M, M // row_chunk, kw


def route_out_shapes(T: int, D: int, E: int, K: int, M: int, block_m: int, chunks: int, h_dtype, x_dtype) -> tuple:
    """The shapes of route_programs' outputs: h_new, x, the logits' partials, weights, idx, row_of, row_copy,
    block_expert."""
    return (jax.ShapeDtypeStruct((T, D), h_dtype), jax.ShapeDtypeStruct((T, D), x_dtype),
            jax.ShapeDtypeStruct((chunks, T, E), jnp.float32), jax.ShapeDtypeStruct((T, K), jnp.float32),
            jax.ShapeDtypeStruct((T, K), jnp.int32), jax.ShapeDtypeStruct((T, K), jnp.int32),
            jax.ShapeDtypeStruct((M,), jnp.int32), jax.ShapeDtypeStruct((M // block_m,), jnp.int32))


@functools.partial(jax.jit, static_argnames=("eps", "k", "num_shared", "block_m", "scoring_func", "norm_topk_prob",
                                             "routed_scaling_factor", "chunks", "num_warps", "interpret"))
def residual_route(parts, h, norm_w, gate, layer, bias=None, *, eps, k, num_shared, block_m, scoring_func="softmax",
                   norm_topk_prob=False, routed_scaling_factor=1.0, chunks=None, num_warps=8, interpret=False):
    """The module docstring: -> (h_new [T, D] in h's dtype, x [T, D] in rms_norm's dtype, weights [T, K] fp32,
    idx [T, K] int32, row_copy [M], block_expert [M // block_m], row_of [T * K]); K = k + num_shared, the
    last four as `moe_route.route_align`'s. 8 warps: the routing's chain of reductions (moe_route's
    measured best). chunks None: `router_chunks` for these sizes and dtypes."""
    S, T, D = parts.shape
    _, D2, E = gate.shape
    x_dtype = jnp.promote_types(norm_w.dtype, h.dtype)
    chunks = chunks or router_chunks(T, D, E, jnp.dtype(x_dtype).itemsize, gate.dtype.itemsize)
    assert D == D2 == h.shape[1] == norm_w.shape[1] and h.shape[0] == T and supported(T, D, E, k, num_shared, chunks), (
        parts.shape, h.shape, norm_w.shape, gate.shape)
    K = k + num_shared
    M, R, route_kw = route_kwargs(T, E, k, num_shared, block_m, scoring_func, norm_topk_prob, routed_scaling_factor)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    params = compiler_params(num_warps, 1, interpret)
    args = (layer, parts, h, norm_w, gate, *(() if bias is None else (bias.astype(jnp.float32),)),
            jnp.zeros((2,), jnp.int32))  # the phases' counters
    out_shape = (*route_out_shapes(T, D, E, K, M, block_m, chunks, h.dtype, x_dtype),
                 jax.ShapeDtypeStruct((2,), jnp.int32))
    h_new, x, _, w, idx, row_of, row_copy, block_expert, _ = pl.pallas_call(
        functools.partial(_kernel, T=T, C=chunks, R=R, eps=float(eps), spin=not interpret, has_bias=bias is not None,
                          route_kw=route_kw),
        grid=(T + chunks + R,), out_shape=out_shape, input_output_aliases={len(args) - 1: 8},
        compiler_params=params, interpret=interpret,
    )(*args)
    return h_new, x, w, idx, row_copy, block_expert, row_of.reshape(-1)


def residual_route_reference(parts, h, norm_w, gate, layer, bias=None, *, eps, k, num_shared, block_m,
                             scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0):
    """Pure JAX, the layer's arithmetic restated: the residual add in h's dtype, rms_norm, the router's fp32
    logits (16-bit products summed in fp32) and `moe_route.route_align_reference`."""
    T = h.shape[0]
    h_new = h + parts[:, :T].sum(axis=0).astype(h.dtype)
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
