"""A decode MoE layer from o_proj's split-K partials to its expert rows, in one launch (Pallas, Triton backend):
kernels/residual_route.py's launch (the residual add, the post-attention RMSNorm, the router's logits, the
routing) and the expert kernels' single launch (kernels/moe_gmm.py `single_launch`) as one grid.

    parts [S, T, D] fp32, h [T, D], norm_w [L, D], gate [L, D, E], bias [E] or None    (as residual_route)
    w_gate_up [L, E, D, 2, I], w_down [L, E, I, D]                                      (as moe_gmm, stacked)
    shared_gate_up [L, D, 2, S*I], shared_down [L, S*I, D] or None                      (the shared MLP)
        -> h_new [T, D], x [T, D], out [T, D] = the MoE block of x (routed + shared), idx [T, k]

Why: with two launches the DRAM idles while the route launch runs (~10-13 us a layer on an H200 at batch 32:
latency-bound rows, a small GEMM and the routing's chain of reductions), and the shared experts' 34.6 MB
(V2-Lite) then stream inside the bandwidth-bound expert launch. Here the shared experts need only x, so their
tiles stream while the router and the routing run, and the routed tiles follow with no launch boundary.

Grid, 1-D (CUDA starts its programs in order; each program waits only on programs before it, on atomic
counters: kernels/launch_sync.py), with Tb = T / (the shared tiles' row block) row blocks per shared expert:
1. T token programs, C router chunks, R routing programs: residual_route's phases (counters 0, 1); each routing
   program adds 1 to counter 2 once its chunk of the alignment is stored. The shared experts' groups sit apart,
   rows M + s * T + t of the intermediate and the output (`moe_route.route_chunk`'s shared_base = M).
2. S * Tb * (I / bn1) shared gate_up tiles: wait for x (counter 0 = T), each adds 1 to its block's counter.
3. nb * (I / bn1) routed gate_up tiles, block-major: wait for the routing (counter 2 = R), then as moe_gmm's
   single launch (an unused block, -1, does nothing).
4. S * Tb * (D / bn2) shared down tiles (before step 3's tiles with shared_down_late=False): wait for their
   block's gate_up tiles; then nb * (D / bn2) routed down tiles, which wait for the routing and their block.
Measured (H200, V2-Lite; benchmarks/RESULTS.md): at batch 32, 264.7-268.1 us a layer against
266.9-270.1 for the two launches, Protocol A +0.15-0.4%. The shared tiles take sizes of their own (`shared_tiles`,
RunnerConfig.decode_moe_shared_tiles): at the routed tiles' 16 rows each shared weight tile was read by two
programs; whole-32-token rows of 64 columns read it once, 262.2 us a layer, the batch-32 step 0.05 ms shorter.
At 16 and 64 tokens the one launch is slower (233 against 232 us, 287 against 285; steps +0.11 and +0.05 ms), at
8 and 128 even: the model runs it at the token counts of RunnerConfig.decode_moe_launch_tokens. A token-dense form
(no alignment, every expert's tiles over all T rows of x from the launch's start) was slower at 16 and 32 tokens
(step 8.12 against 8.01 ms) and is not kept.

Three parts (ARCHITECTURE.md rule 6): `route_experts` (the kernel; `interpret=True` runs it on the CPU) and
`route_experts_reference` (pure JAX: residual_route_reference's routing, every copy through its expert and the
shared MLP as S more experts, summed in fp32). In interpret mode its outputs equal, bit for bit, residual_route
followed by moe_route.moe_fused_decode's single launch (the same tile sums per row).
Invariants: residual_route's (`supported`) and T a multiple of the row block.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.kernels import launch_sync
from deepinfer_jax.kernels.moe_gmm import (combine_rows, down_rows, down_tile, fit_tile, gate_up_rows, gate_up_tile,
                                           moe_experts_reference)
from deepinfer_jax.kernels.moe_gmm import single_launch_tiles
from deepinfer_jax.kernels.moe_route import decode_block_m, route_chunk
from deepinfer_jax.kernels.residual_route import (residual_route_reference, route_kwargs, route_out_shapes,
                                                  route_programs, router_chunks, supported)
from deepinfer_jax.kernels.triton_params import compiler_params

ROUTED = 2  # the counter the routing programs add to; block b's gate_up tiles add to counter BLOCKS + b
BLOCKS = 3


def _segments(first: int, shared_tiles: tuple[int, int], routed_tiles: tuple[int, int], shared_down_late: bool):
    """{segment: (first program, programs)} of the expert programs after the `first` routing programs: the
    shared gate_up and down tiles ("sgu", "sd") and the routed ones ("rgu", "rd"), in launch order."""
    order = ("sgu", "rgu", "sd", "rd") if shared_down_late else ("sgu", "sd", "rgu", "rd")
    sizes = {"sgu": shared_tiles[0], "sd": shared_tiles[1], "rgu": routed_tiles[0], "rd": routed_tiles[1]}
    out = {}
    for name in order:
        out[name] = (first, sizes[name])
        first += sizes[name]
    return out


def _kernel(layer_ref, parts_ref, h_ref, nw_ref, g_ref, wgu_ref, wd_ref, *refs, T, C, R, M, t1, t2, ts1, ts2, has_bias,
            shared, eps, spin, route_kw, shared_down_late):
    refs = list(refs)
    bias_ref = refs.pop(0) if has_bias else None
    sgu_ref, sd_ref = (refs.pop(0), refs.pop(0)) if shared else (None, None)
    _cnt_in, hn_ref, x_ref, lp_ref, w_ref, idx_ref, row_of_ref, row_copy_ref, be_ref, act_ref, y_ref, cnt_ref = refs
    p, layer = pl.program_id(0), layer_ref[0]
    route_programs(p, layer, parts_ref, h_ref, nw_ref, g_ref, hn_ref, x_ref, lp_ref, cnt_ref,
                   lambda r, logits: route_chunk(r, logits, bias_ref, w_ref, idx_ref, row_of_ref, row_copy_ref, be_ref,
                                                 **route_kw),
                   T=T, C=C, R=R, eps=eps, spin=spin, routed_counter=ROUTED)
    bm, I, S = ts1.block_m, t1.I, route_kw["S"] if shared else 0  # bm, Tb: the shared tiles' row blocks
    nb, Tb = be_ref.shape[0], T // bm
    tiles1, tiles2 = I // t1.block_n, y_ref.shape[1] // t2.block_n
    stiles1, stiles2 = I // ts1.block_n, y_ref.shape[1] // ts2.block_n
    release = lambda i: launch_sync.release(cnt_ref, i, spin)  # noqa: E731
    acquire = lambda i, target: launch_sync.acquire(cnt_ref, i, target, spin)  # noqa: E731
    seg = _segments(T + C + R, (S * Tb * stiles1, S * Tb * stiles2), (nb * tiles1, nb * tiles2), shared_down_late)

    def within(name):
        start, n = seg[name]
        return (p >= start) & (p < start + n), p - start

    if S:
        on, q = within("sgu")

        @pl.when(on)  # shared gate_up tiles
        def _():
            sb, n = q // stiles1, q % stiles1  # shared block sb: expert sb // Tb, tokens (sb % Tb) * bm ..
            cols = pl.ds(n * ts1.block_n, ts1.block_n)
            tokens = pl.ds((sb % Tb) * bm, bm)
            acquire(0, T)
            gate_up_rows(ts1, lambda ks: x_ref[tokens, ks],
                         lambda ks, g: sgu_ref[layer, ks, g, pl.ds((sb // Tb) * I + n * ts1.block_n, ts1.block_n)],
                         act_ref, pl.ds(M + sb * bm, bm), cols)
            release(BLOCKS + nb + sb)

        on, q = within("sd")

        @pl.when(on)  # shared down tiles
        def _():
            sb, n = q // stiles2, q % stiles2
            acquire(BLOCKS + nb + sb, stiles1)
            down_rows(ts2, act_ref, lambda i: sd_ref[layer, pl.ds((sb // Tb) * I + i * ts2.block_k, ts2.block_k),
                                                     pl.ds(n * ts2.block_n, ts2.block_n)],
                      y_ref, pl.ds(M + sb * bm, bm), pl.ds(n * ts2.block_n, ts2.block_n))

    on, q = within("rgu")

    @pl.when(on)  # routed gate_up tiles, block-major
    def _():
        b = q // tiles1
        acquire(ROUTED, R)
        gate_up_tile(t1, b, q % tiles1, layer_ref, be_ref, x_ref, wgu_ref, None, row_copy_ref, act_ref, False,
                 after=lambda: release(BLOCKS + b))

    on, q = within("rd")

    @pl.when(on)  # routed down tiles, block-major
    def _():
        b, n = q // tiles2, q % tiles2
        acquire(ROUTED, R)
        down_tile(t2, b, n, layer_ref, be_ref, act_ref, wd_ref, None, y_ref, before=lambda: acquire(BLOCKS + b, tiles1))


@functools.partial(jax.jit, static_argnames=("eps", "k", "scoring_func", "norm_topk_prob", "routed_scaling_factor",
                                             "chunks", "num_warps", "shared_down_late", "shared_tiles",
                                             "interpret"))
def route_experts(parts, h, norm_w, gate, layer, w_gate_up, w_down, shared_gate_up=None, shared_down=None, bias=None, *,
                  eps, k, scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0,
                  chunks=None, num_warps=8, shared_down_late=True, shared_tiles=None,
                  interpret=False):
    """The module docstring -> (h_new [T, D] in h's dtype, x [T, D] in rms_norm's dtype, out, idx [T, k]): out the
    MoE block of x [T, D] in x's dtype.
    num_warps: the launch's warps (None: the expert tiles', moe_gmm.tile_config); shared_down_late: launch the
    shared down tiles after the routed gate_up tiles instead of before them. The defaults (8 warps, late) are
    the measured best on an H200 (V2-Lite, batch 32, `benchmarks/moe_launch_sweep.py`): 268.1 us a
    layer against 271.1 at 4 warps and 270.1 for the two launches; the order alone made no difference (the
    routing's chain of reductions runs faster at 8 warps, the expert tiles did not slow).
    shared_tiles: (block_m, gate_up block_n, down block_n) of the shared experts' tiles, the row block cut to its
    greatest common divisor with T (None: the routed tiles'); e.g. whole-T row blocks and narrow columns, so that
    more programs stream the shared weights while the routing runs. The sums per row are the same dots in other
    tiles: equal within fp32 rounding. On an H200 (V2-Lite, batch 32, moe_launch_sweep.py): (32, 64, 256),
    44 gate_up programs of 64 columns that read each weight tile once, 262.2 us a layer against 263.9-265.0 at the
    routed tiles' (16, 128, 256); (16, 64, 256) 263.2, (32, 32, 256) 263.9, (32, 16, 256) 273.0."""
    _, T, D = parts.shape
    _, E, _, _, I = w_gate_up.shape
    S = 0 if shared_gate_up is None else shared_gate_up.shape[-1] // I
    K = k + S
    block_m = decode_block_m(T, k, S)
    x_dtype = jnp.promote_types(norm_w.dtype, h.dtype)
    chunks = chunks or router_chunks(T, D, E, jnp.dtype(x_dtype).itemsize, gate.dtype.itemsize)  # residual_route's
    assert supported(T, D, E, k, S, chunks) and T % block_m == 0, (parts.shape, w_gate_up.shape, k, S)
    M, R, route_kw = route_kwargs(T, E, k, S, block_m, scoring_func, norm_topk_prob, routed_scaling_factor,
                                  shared_apart=True)
    t1, t2, warps, num_stages = single_launch_tiles(T * K, D, E, I, K, block_m, x_dtype)
    ts1, ts2 = t1, t2
    if shared_tiles is not None:
        sbm, sbn1, sbn2 = shared_tiles
        sbm = math.gcd(sbm, T)
        assert sbm >= 16, (T, shared_tiles)
        ts1 = dataclasses.replace(t1, block_m=sbm, block_n=fit_tile(sbn1, I))
        ts2 = dataclasses.replace(t2, block_m=sbm, block_n=fit_tile(sbn2, D))
    nb, rows = M // block_m, M + S * T
    tiles1, tiles2 = I // t1.block_n, D // t2.block_n
    grid = T + chunks + R + nb * (tiles1 + tiles2) + S * T // ts1.block_m * (I // ts1.block_n + D // ts2.block_n)
    shared = () if S == 0 else (shared_gate_up.astype(x_dtype), shared_down.astype(x_dtype))
    args = (jnp.asarray(layer, jnp.int32).reshape(1), parts, h, norm_w, gate, w_gate_up.astype(x_dtype),
            w_down.astype(x_dtype), *(() if bias is None else (bias.astype(jnp.float32),)), *shared,
            jnp.zeros((BLOCKS + nb + S * T // ts1.block_m,), jnp.int32))  # the counters
    out_shape = (*route_out_shapes(T, D, E, K, M, block_m, chunks, h.dtype, x_dtype),
                 jax.ShapeDtypeStruct((rows, I), x_dtype), jax.ShapeDtypeStruct((rows, D), x_dtype),
                 jax.ShapeDtypeStruct(args[-1].shape, jnp.int32))
    h_new, x, _, w, idx, row_of, _, _, _, y, _ = pl.pallas_call(
        functools.partial(_kernel, T=T, C=chunks, R=R, M=M, t1=t1, t2=t2, ts1=ts1, ts2=ts2, has_bias=bias is not None,
                          shared=bool(S), eps=float(eps), spin=not interpret, route_kw=route_kw,
                          shared_down_late=shared_down_late),
        grid=(grid,), out_shape=out_shape, input_output_aliases={len(args) - 1: len(out_shape) - 1},
        compiler_params=compiler_params(num_warps or warps, num_stages, interpret), interpret=interpret,
    )(*args)
    row_of = row_of.reshape(-1)
    out = combine_rows(y, row_of, w, T, K, D, x_dtype)
    return h_new, x, out, idx[:, :k]


def route_experts_reference(parts, h, norm_w, gate, layer, w_gate_up, w_down, shared_gate_up=None, shared_down=None,
                            bias=None, *, eps, k, scoring_func="softmax", norm_topk_prob=False,
                            routed_scaling_factor=1.0):
    """Pure JAX: residual_route_reference's h_new, x and routing, then every routed copy through its expert and
    the shared MLP as S experts of width I with weight 1 (its SwiGLU splits exactly over the intermediate
    dim), summed in fp32 and rounded once (moe_gmm.moe_experts_reference) -> (h_new, x, out, idx [T, k])."""
    h_new, x, w, idx, *_ = residual_route_reference(parts, h, norm_w, gate, layer, bias, eps=eps, k=k, num_shared=0,
                                                    block_m=16, scoring_func=scoring_func,
                                                    norm_topk_prob=norm_topk_prob,
                                                    routed_scaling_factor=routed_scaling_factor)
    wgu, wd = w_gate_up[layer], w_down[layer]  # [E, D, 2, I], [E, I, D]
    E, D, _, I = wgu.shape
    w_all, idx_all = w, idx
    if shared_gate_up is not None:
        S = shared_gate_up.shape[-1] // I
        sgu = shared_gate_up[layer].reshape(D, 2, S, I).transpose(2, 0, 1, 3)  # [S, D, 2, I]
        wgu = jnp.concatenate([wgu, sgu.astype(wgu.dtype)])
        wd = jnp.concatenate([wd, shared_down[layer].reshape(S, I, D).astype(wd.dtype)])
        T = x.shape[0]
        idx_all = jnp.concatenate([idx, jnp.broadcast_to(E + jnp.arange(S, dtype=idx.dtype), (T, S))], axis=1)
        w_all = jnp.concatenate([w, jnp.ones((T, S), w.dtype)], axis=1)
    out = moe_experts_reference(x, wgu.astype(x.dtype), wd.astype(x.dtype), w_all, idx_all)
    return h_new, x, out, idx
