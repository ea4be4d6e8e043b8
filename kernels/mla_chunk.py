"""MLA prefill attention of a step's new tokens among themselves, in the expanded form (Pallas, Triton).

Prefill attention in the absorbed form (`mla_prefill`) costs 2 x (R + dr + R) = 2,176 FLOPs per query
head and key; expanded, with keys and values rebuilt from the new tokens' latents through kv_b_proj
(dn + dr = 192-wide keys, dv = 128-wide values), it costs 2 x (dn + dr + dv) = 640: 3.4x less, for
the price of one [T, R] x [R, H, dn + dv] GEMM a layer. A prefill step's attention is therefore split
in two (as SGLang and vLLM do): this kernel takes each new token against the new tokens of its own
chunk (causal), and `mla_prefill` (context_only) takes it against the cached context before the chunk;
`merge_with_context` adds the two with log-sum-exp weights.

Layout: the step's tokens are runs (a sequence's chunk: consecutive slots of one seq_id with rising
positions, `mla_prefill.run_starts`); query blocks of `block_q` tokens never cross a run
(`mla_prefill.query_blocks`). Program = (query block, head): it walks the keys of its run from the
run's first token up to its own last token, `block_k` at a time, with an fp32 online softmax, and
stores the unnormalised accumulator, the running max and the sum (the merge normalises). The query
and key tiles are windows kept in bounds as in `mla_prefill` (rows outside the block are masked on
store; keys outside [a block's key range] are masked in the scores).

    q_nope [T, H, dn], q_pe [T, H, dr] (roped), kv [T, H, dn + dv] (k_nope | v per head),
    k_pe [T, dr] (roped, shared by the heads) -> acc [T, H, dv] fp32, m [T, H], l [T, H]

Invariant: every row of a block sees at least its own key in the first key block, so l > 0 and m is
finite for every stored row. `chunk_attention_reference` (pure JAX) defines the semantics;
`interpret=True` runs the kernel on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from deepinfer_jax.kernels.mla_decode import EXACT, NEG, softmax_step
from deepinfer_jax.kernels.triton_params import compiler_params


def supported(dn: int, dr: int, dv: int, interpret: bool = False) -> bool:
    """Head dims the Triton tiles take: powers of two of at least 16 (any in interpret mode)."""
    return interpret or all(d >= 16 and d & (d - 1) == 0 for d in (dn, dr, dv))


def key_block(qn, qp, kv_ref, kpe_ref, h, k0, block_k: int, dn: int, dv: int):
    """The query tile (qn [bq, dn], qp [bq, dr]) against keys k0 .. k0 + block_k - 1 of kv_ref [N, H, dn + dv] (head
    h's k_nope | v) and kpe_ref [N, dr] (the shared roped k_pe): -> (scores [bq, bk] fp32, unscaled; values [bk, dv])."""
    kn = kv_ref[pl.ds(k0, block_k), h, pl.ds(0, dn)]  # [bk, dn]
    v = kv_ref[pl.ds(k0, block_k), h, pl.ds(dn, dv)]  # [bk, dv]
    kp = kpe_ref[pl.ds(k0, block_k), :]  # [bk, dr]
    s = jnp.dot(qn, kn.T, preferred_element_type=jnp.float32, precision=EXACT)
    return s + jnp.dot(qp, kp.T, preferred_element_type=jnp.float32, precision=EXACT), v


def _kernel(first_ref, count_ref, rs_ref, qn_ref, qp_ref, kv_ref, kpe_ref, o_ref, *lse_refs,
            block_q, block_k, dn, dv, num_tokens, scale):
    b, h = pl.program_id(0), pl.program_id(1)
    first, count = first_ref[b], count_ref[b]

    @pl.when(count > 0)
    def _():
        q0 = jnp.minimum(first, num_tokens - block_q)  # in-bounds window holding the block
        qn = qn_ref[pl.ds(q0, block_q), h, :]  # [bq, dn]
        qp = qp_ref[pl.ds(q0, block_q), h, :]  # [bq, dr]
        qi = q0 + jnp.arange(block_q)  # token index of each row
        start = rs_ref[first]  # the run's first token
        end = first + count  # keys < end (each row: keys <= its own index)

        def body(j, carry):
            lo = start + j * block_k
            k0 = jnp.minimum(lo, num_tokens - block_k)
            ki = k0 + jnp.arange(block_k)
            s, v = key_block(qn, qp, kv_ref, kpe_ref, h, k0, block_k, dn, dv)
            ok = (ki[None, :] >= lo) & (ki[None, :] <= qi[:, None])
            return softmax_step(jnp.where(ok, s * scale, NEG), v, carry)

        init = (jnp.zeros((block_q, dv), jnp.float32), jnp.full((block_q,), NEG, jnp.float32),
                jnp.zeros((block_q,), jnp.float32))
        n_blocks = (end - start + block_k - 1) // block_k
        acc, m, l = jax.lax.fori_loop(0, n_blocks, body, init)
        mine = (qi >= first) & (qi < end)
        o = acc if lse_refs else (acc / l[:, None]).astype(o_ref.dtype)  # normalised: l >= 1 (its own key)
        plgpu.store(o_ref.at[pl.ds(q0, block_q), h, :], o, mask=jnp.broadcast_to(mine[:, None], o.shape))
        for ref, v in zip(lse_refs, (m, l)):
            plgpu.store(ref.at[pl.ds(q0, block_q), h], v, mask=mine)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "num_warps", "num_stages", "out_dtype",
                                             "interpret"))
def chunk_attention(q_nope, q_pe, kv, k_pe, run_start, blocks, scale, *, block_q, block_k=64, num_warps=4,
                    num_stages=2, out_dtype=None, interpret=False):
    """-> (acc [T, H, dv] fp32, m [T, H], l [T, H]); module docstring. `blocks` = (first, count) from
    `mla_prefill.query_blocks` with this block_q (which must be at most T); run_start [T] int32 from
    `mla_prefill.run_starts`; block_k at most T. With `out_dtype` (a step with no cached context, nothing to
    merge): -> o [T, H, dv] in out_dtype, acc / l, as `normalise` gives it (one fp32 division a row, rounded
    once), without the fp32 [T, H, dv] round trip through memory."""
    T, H, dn = q_nope.shape
    dv = kv.shape[-1] - dn
    first, count = (b.astype(jnp.int32) for b in blocks)
    stages = num_stages if q_nope.dtype.itemsize < 4 else 1
    params = compiler_params(num_warps, stages, interpret)
    kernel = functools.partial(_kernel, block_q=block_q, block_k=min(block_k, T), dn=dn, dv=dv, num_tokens=T,
                               scale=scale)
    out_shape = [jax.ShapeDtypeStruct((T, H, dv), jnp.float32), jax.ShapeDtypeStruct((T, H), jnp.float32),
                 jax.ShapeDtypeStruct((T, H), jnp.float32)]
    if out_dtype is not None:
        out_shape = jax.ShapeDtypeStruct((T, H, dv), out_dtype)
    return pl.pallas_call(kernel, grid=(first.shape[0], H), out_shape=out_shape, compiler_params=params,
                          interpret=interpret)(first, count, run_start.astype(jnp.int32), q_nope, q_pe, kv, k_pe)


def chunk_attention_reference(q_nope, q_pe, kv, k_pe, run_start, scale):
    """Pure JAX: token t attends to the tokens run_start[t] .. t of the step (fp32)."""
    T, H, dn = q_nope.shape
    f32 = jnp.float32
    s = jnp.einsum("thd,khd->htk", q_nope.astype(f32), kv[..., :dn].astype(f32), precision=EXACT)
    s = s + jnp.einsum("thd,kd->htk", q_pe.astype(f32), k_pe.astype(f32), precision=EXACT)
    t = jnp.arange(T)
    ok = (t[None, :] >= run_start[:, None]) & (t[None, :] <= t[:, None])  # [T(query), T(key)]
    s = jnp.where(ok[None], s * scale, NEG)
    m = s.max(axis=-1)  # [H, T]
    p = jnp.exp(s - m[..., None])
    acc = jnp.einsum("htk,khv->thv", p, kv[..., dn:].astype(f32), precision=EXACT)
    return acc, m.T, p.sum(axis=-1).T


def normalise(acc1, m1, l1):
    """The chunk part alone (acc1 [T, H, dv] unnormalised, l1 [T, H]; m1 unused) -> o [T, H, dv] fp32:
    `merge_with_context` where no row has context (o_ctx = 0, m2 = NEG, l2 = 0), bit for bit."""
    del m1
    return acc1.astype(jnp.float32) / l1[..., None]


def merge_with_context(acc1, m1, l1, o_ctx, m2, l2):
    """The chunk part (acc1 [T, H, dv] unnormalised, m1, l1 [T, H]) plus the cached-context part,
    already in value space and normalised (o_ctx [T, H, dv], with its m2 and l2; l2 = 0 where a row
    has no context) -> o [T, H, dv] fp32, the softmax over both key sets."""
    M = jnp.maximum(m1, m2)
    w1, w2 = jnp.exp(m1 - M), jnp.exp(m2 - M) * l2
    num = w1[..., None] * acc1 + w2[..., None] * o_ctx.astype(jnp.float32)
    return num / (w1 * l1 + w2)[..., None]
