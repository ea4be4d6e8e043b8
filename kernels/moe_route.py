"""Fused MoE routing and token alignment for decode-size steps, in Pallas (Triton backend).

From the router logits to everything the grouped-GEMM kernels of `moe_gmm` need, in one launch
instead of ~15 small XLA kernels (softmax, the top-k sort and its copies, the compare-and-count
reductions, cumsums, selects):

    logits [T, E] fp32 -> weights [T, K] fp32, idx [T, K] int32              (K = k + S)
                          row_copy [M] int32, block_expert [M // block_m] int32, row_of [T * K] int32

Routing is HF's greedy top-k (n_group = 1): scores = softmax(logits) or sigmoid(logits); the experts
are chosen on scores (+ the noaux_tc correction bias), lowest index first among ties (as
`lax.top_k`); weights are the unbiased scores of the chosen experts, normalised when
`norm_topk_prob`, times `routed_scaling_factor`. The S shared experts (ids E .. E+S-1, weight 1)
follow each token's k routed copies: copy index t*K + j. The alignment is `moe_gmm.align_tokens`'s
layout (experts' groups padded to block_m rows, copies of one expert in copy order) with
M = next_pow2(T*K + (E+S)*(block_m - 1)), so that every array is a power of two long.

Grid: row chunks of `row_chunk` rows. Every program recomputes the routing (a few [T, E] passes) and
writes its chunk of row_copy and its blocks of block_expert; program 0 also writes the weights, ids
and row_of. Limits: T and E powers of two, T * K <= 2048 (decode buckets; prefill sizes keep the XLA
route and the sort-based alignment).

`route_align_reference` (pure JAX) defines the semantics; `interpret=True` runs the kernel on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.kernels.moe_gmm import align_tokens, moe_experts_aligned, tile_config
from deepinfer_jax.kernels.triton_params import compiler_params

MAX_COPIES = 2048


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def padded_rows(num_tokens: int, k: int, num_shared: int, num_experts: int, block_m: int) -> int:
    """M: the padded row count of the aligned copies, a power of two."""
    return _pow2(num_tokens * (k + num_shared) + (num_experts + num_shared) * (block_m - 1))


def supported(num_tokens: int, num_experts: int, k: int, num_shared: int) -> bool:
    """Whether the fused kernel handles this step (else: the XLA route and `align_tokens`)."""
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return pow2(num_tokens) and pow2(num_experts) and num_tokens * (k + num_shared) <= MAX_COPIES


def _kernel(logits_ref, *refs, k, S, block_m, softmax, norm, scale, row_chunk):
    bias_ref = refs[0] if len(refs) == 6 else None
    route_chunk(pl.program_id(0), logits_ref[...], bias_ref, *refs[-5:], k=k, S=S, block_m=block_m,
                softmax=softmax, norm=norm, scale=scale, row_chunk=row_chunk)


def route_topk(x, bias_ref, *, k, softmax, norm, scale):
    """The routing of logits x [T, E] fp32 (module docstring): (ids, weights) as k lists of [T] (a token's j-th
    choice), and chosen [T, E] int32, 1 where token t chose expert e."""
    T, E = x.shape
    if softmax:
        ex = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
        s = ex / jnp.sum(ex, axis=1, keepdims=True)
    else:
        s = jax.nn.sigmoid(x)
    choice = s if bias_ref is None else s + bias_ref[...][None, :]  # noaux_tc's correction bias
    eio = jax.lax.broadcasted_iota(jnp.int32, (T, E), 1)
    ids, ws = [], []
    chosen = jnp.zeros((T, E), jnp.int32)  # 1 where token t chose expert e
    for _ in range(k):
        m = jnp.max(choice, axis=1)  # [T]
        e_j = jnp.min(jnp.where(choice == m[:, None], eio, E), axis=1)  # lowest index of the max
        hit = eio == e_j[:, None]
        # Without a bias the chosen score is the max itself: one reduction fewer per expert.
        ws.append(m if bias_ref is None else jnp.sum(jnp.where(hit, s, 0.0), axis=1))
        ids.append(e_j)
        chosen = chosen + hit.astype(jnp.int32)
        choice = jnp.where(hit, -jnp.inf, choice)
    if norm:
        total = functools.reduce(jnp.add, ws) + 1e-20
        ws = [w / total for w in ws]
    return ids, [w * scale for w in ws], chosen


def route_chunk(c, x, bias_ref, w_ref, idx_ref, row_of_ref, row_copy_ref, be_ref, *, k, S, block_m, softmax, norm,
                scale, row_chunk, shared_base=None):
    """Program c of the routing kernel, from the logits x [T, E] fp32: the routing (every program) and the
    c-th row chunk of the alignment; chunk 0 also writes the weights, ids and row_of. Shared with kernels
    that route inside a larger launch (kernels/residual_route.py, kernels/route_experts.py).
    shared_base: where a launch runs the shared experts' rows apart (kernels/route_experts.py), shared expert
    s's group is rows shared_base + s * T_pad .. (T_pad: T padded to block_m), past the aligned rows, and no
    block of block_expert (nor row of row_copy) covers it; None: the groups follow the routed ones."""
    T, E = x.shape
    K = k + S
    ids, ws, chosen = route_topk(x, bias_ref, k=k, softmax=softmax, norm=norm, scale=scale)
    eio = jax.lax.broadcasted_iota(jnp.int32, (T, E), 1)
    tio = jax.lax.broadcasted_iota(jnp.int32, (T,), 0)

    # Alignment. Routed expert e's group: rows starts[e] .. + counts[e] (padded to block_m); the shared
    # experts' groups follow, T rows each (padded). A copy's rank in its group = earlier tokens that
    # chose the same expert (a token's k experts are distinct).
    counts = jnp.sum(chosen, axis=0)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = jnp.cumsum(padded)  # [E] inclusive
    starts = ends - padded
    routed_rows = jnp.sum(padded)
    shared_pad = (T + block_m - 1) // block_m * block_m
    earlier = jnp.cumsum(chosen, axis=0) - chosen  # [T, E]
    rows = []
    for j in range(K):
        if j < k:
            hit = eio == ids[j][:, None]
            rows.append(jnp.sum(jnp.where(hit, starts[None, :] + earlier, 0), axis=1))  # [T]
        else:
            base = routed_rows if shared_base is None else shared_base
            rows.append(base + (j - k) * shared_pad + tio)

    @pl.when(c == 0)
    def _():
        for j in range(K):
            w_ref[:, j] = ws[j] if j < k else jnp.ones((T,), jnp.float32)
            idx_ref[:, j] = ids[j] if j < k else jnp.full((T,), E + j - k, jnp.int32)
            row_of_ref[:, j] = rows[j]

    # This program's rows: the copy placed there (one at most), or -1. A row holds at most one copy, so
    # the K copies' matches add up elementwise and one reduction finds it.
    r = c * row_chunk + jax.lax.broadcasted_iota(jnp.int32, (row_chunk, T), 0)  # [chunk, T]
    found = jnp.zeros((row_chunk, T), jnp.int32)
    for j in range(K):
        found = found + jnp.where(rows[j][None, :] == r, tio[None, :] * K + j + 1, 0)
    row_copy_ref[pl.ds(c * row_chunk, row_chunk)] = jnp.sum(found, axis=1) - 1

    # This program's blocks: the expert whose padded group holds the block's first row, or -1.
    nb = row_chunk // block_m
    start = c * row_chunk + jax.lax.broadcasted_iota(jnp.int32, (nb,), 0) * block_m  # [nb]
    n_before = jnp.sum((start[:, None] >= ends[None, :]).astype(jnp.int32), axis=1)  # routed groups ended
    past = jnp.maximum(start - routed_rows, 0) // shared_pad  # shared groups ended (start >= routed_rows)
    be = jnp.where(start >= routed_rows, E + past, n_before)
    shared_end = routed_rows + (0 if shared_base is not None else S * shared_pad)
    be_ref[pl.ds(c * nb, nb)] = jnp.where(start < shared_end, be, -1)


@functools.partial(jax.jit, static_argnames=("k", "num_shared", "block_m", "scoring_func", "norm_topk_prob",
                                             "routed_scaling_factor", "interpret"))
def route_align(logits, bias, *, k, num_shared, block_m, scoring_func="softmax", norm_topk_prob=False,
                routed_scaling_factor=1.0, interpret=False):
    """logits [T, E] fp32, bias [E] fp32 (the noaux_tc correction bias) or None ->
    (weights [T, K], idx [T, K], row_copy [M], block_expert [M // block_m], row_of [T * K]); module
    docstring. Requires `supported(T, E, k, num_shared)`."""
    T, E = logits.shape
    K = k + num_shared
    if not supported(T, E, k, num_shared):
        raise ValueError(f"route_align handles T, E powers of two and T*(k+S) <= {MAX_COPIES}; got T={T}, E={E}, "
                         f"k={k}, S={num_shared}")
    M = padded_rows(T, k, num_shared, E, block_m)
    row_chunk = min(M, 128)
    # A chain of small reductions: 8 warps 7.4 us a layer on an H200, 4 warps 8.5, 2 warps 31, 16 warps 7.8
    # (V2-Lite, batch 32; benchmarks/RESULTS.md).
    params = compiler_params(8, 1, interpret)
    out_shape = (jax.ShapeDtypeStruct((T, K), jnp.float32), jax.ShapeDtypeStruct((T, K), jnp.int32),
                 jax.ShapeDtypeStruct((T, K), jnp.int32), jax.ShapeDtypeStruct((M,), jnp.int32),
                 jax.ShapeDtypeStruct((M // block_m,), jnp.int32))
    w, idx, row_of, row_copy, block_expert = pl.pallas_call(
        functools.partial(_kernel, k=k, S=num_shared, block_m=block_m, softmax=scoring_func == "softmax",
                          norm=norm_topk_prob, scale=float(routed_scaling_factor), row_chunk=row_chunk),
        grid=(M // row_chunk,), out_shape=out_shape, compiler_params=params, interpret=interpret,
    )(logits.astype(jnp.float32), *(() if bias is None else (bias.astype(jnp.float32),)))
    return w, idx, row_copy, block_expert, row_of.reshape(-1)


def route_align_reference(logits, bias, *, k, num_shared, block_m, scoring_func="softmax", norm_topk_prob=False,
                          routed_scaling_factor=1.0):
    """Pure JAX, the same outputs: `lax.top_k` routing, then `align_tokens` on the copies with the shared
    experts appended, its rows padded to the kernel's power-of-two M."""
    T, E = logits.shape
    x = logits.astype(jnp.float32)
    s = jax.nn.softmax(x, axis=-1) if scoring_func == "softmax" else jax.nn.sigmoid(x)
    _, idx = jax.lax.top_k(s if bias is None else s + bias.astype(jnp.float32)[None, :], k)
    w = jnp.take_along_axis(s, idx, axis=-1)
    if norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    w = w * routed_scaling_factor
    idx = jnp.concatenate([idx.astype(jnp.int32),
                           jnp.broadcast_to(E + jnp.arange(num_shared, dtype=jnp.int32), (T, num_shared))], axis=1)
    w = jnp.concatenate([w, jnp.ones((T, num_shared), jnp.float32)], axis=1)
    row_copy, block_expert, row_of = align_tokens(idx, E + num_shared, block_m)
    M = padded_rows(T, k, num_shared, E, block_m)
    row_copy = jnp.full((M,), -1, jnp.int32).at[: row_copy.shape[0]].set(row_copy)
    block_expert = jnp.full((M // block_m,), -1, jnp.int32).at[: block_expert.shape[0]].set(block_expert)
    return w, idx, row_copy, block_expert, row_of


def decode_block_m(num_tokens: int, k: int, num_shared: int) -> int:
    """The row block of a decode-size step's aligned copies (`moe_gmm.tile_config`)."""
    return tile_config(num_tokens * (k + num_shared))[0]


def moe_fused_decode(x, logits, bias, w_gate_up, w_down, layer=None, shared_gate_up=None, shared_down=None, *,
                     k, scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0, single_launch=False,
                     routed=None, interpret=False):
    """Routing, alignment and the expert kernels of a decode-size step: `route_align` then
    `moe_gmm.moe_experts_aligned` (shared experts inside the kernels when given; the gate_up kernel
    gathers its rows' tokens from x itself, so no XLA op sits between the router GEMM and the kernels).
    x [T, D], logits [T, E] fp32, bias [E] or None (`route_align`); weights as `moe_gmm.moe_experts` -> (out [T, D], idx [T, k]).
    single_launch: both expert kernels in one launch (`moe_gmm.moe_experts_aligned`). routed: `route_align`'s five
    outputs when a launch before routed already (kernels/residual_route.py); logits and bias are then unused."""
    if layer is None:
        w_gate_up, w_down, layer = w_gate_up[None], w_down[None], 0
        if shared_gate_up is not None:
            shared_gate_up, shared_down = shared_gate_up[None], shared_down[None]
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    T = x.shape[0]
    I = w_gate_up.shape[-1]
    S = 0 if shared_gate_up is None else shared_gate_up.shape[-1] // I
    block_m = decode_block_m(T, k, S)
    w, idx, row_copy, block_expert, row_of = routed if routed is not None else route_align(
        logits, bias, k=k, num_shared=S, block_m=block_m, scoring_func=scoring_func, norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=routed_scaling_factor, interpret=interpret)
    shared = () if shared_gate_up is None else (shared_gate_up, shared_down)
    out = moe_experts_aligned(x, w_gate_up, w_down, w, row_copy, block_expert, row_of, layer, *shared,
                              block_m=block_m, gather_in_kernel=True, single_launch=single_launch,
                              interpret=interpret)
    return out, idx[:, :k]
