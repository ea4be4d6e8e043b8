"""MLA prefill attention of long chunks against their cached context, in the expanded form (Pallas, Triton).

`mla_chunk` takes a prefill step's tokens against the new tokens of their own chunk in the expanded form;
against the cached context before the chunk, `mla_prefill` (context-only) runs in the absorbed form, 2 x (R + dr
+ R) = 2,176 FLOPs per query head and key (R = 512, dr = 64). Expanded, with the context's keys and values
rebuilt from its cached latents through kv_b_proj, a key costs 2 x (dn + dr + dv) = 640 (dn = dv = 128), for the
price of up-projecting each context token once per step: 2 x R x H x (dn + dv) FLOPs, which the savings of
2 x R x (dn + dv) / 1,536 = 171 query tokens pay back, at any head count. So a chunk of many new tokens
over a long context (a long prompt's later chunks) takes this path and a short run (a decode token, a prompt's
short tail) keeps the absorbed one: `plan` picks the runs of at least `min_queries` tokens with context.

Windows. The picked runs' contexts are laid end to end (`cu`, per sequence row: the context of row s is flat
keys cu[s] .. cu[s + 1]) and walked `window` keys at a time: each window's latents are gathered from the
pages, split into c_kv and the (roped) k_pe and up-projected into [window, H, dn + dv]; then one kernel call
continues every picked block's online softmax over the window's keys of its own sequence. The state
(acc [T, H, dv] fp32, m [T, H], l [T, H]) is the chunk part's, aliased in and out, so the chunk part, every
window and (for the other runs) the absorbed context part merge without another pass: rows of blocks with no
keys in a window are left as they were.

Program = (query block, head), the blocks of `mla_prefill.query_blocks` (a block never crosses a run): its
query tile is read from an in-bounds window of block_q tokens, its keys from [k_lo, k_hi) of the window
(block_k at a time, the tile clamped in bounds and masked to the range); masked store of its own rows.

Invariant: a block's state on entry has a finite max for each of its rows (the chunk part saw at least the
row's own key), so a key block masked out entirely leaves it unchanged. `expanded_context_reference` (pure
JAX) defines the semantics; `interpret=True` runs the kernel on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from deepinfer_jax.kernels.mla_chunk import key_block
from deepinfer_jax.kernels.mla_decode import EXACT, NEG, softmax_step
from deepinfer_jax.kernels.triton_params import compiler_params

# Bytes of one window's up-projected keys and values ([window, H, dn + dv] in the compute dtype): the window is
# the largest power of two of keys within this, between 256 and 8,192 (V2-Lite's 16 heads: 8,192; V3's 128: 1,024).
WINDOW_BYTES = 64 << 20


def window_size(num_heads: int, kv_width: int, itemsize: int) -> int:
    """Keys per window for H = num_heads heads of dn + dv = kv_width values of `itemsize` bytes."""
    w = 256
    while w < 8192 and 2 * w * num_heads * kv_width * itemsize <= WINDOW_BYTES:
        w *= 2
    return w


def plan(seq_ids, positions, run_start, num_rows: int, min_queries: int):
    """Which runs attend to their context here. -> (picked [T] bool: the token's run has at least `min_queries`
    tokens and some context; cu [S + 1] int32: the picked rows' contexts laid end to end, row s's keys are
    positions 0 .. cu[s + 1] - cu[s] - 1 of its sequence). A run's context is its first token's position (the
    keys before the chunk); each sequence row has at most one run in a step, padding runs start at position 0."""
    T = seq_ids.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    run_len = jnp.zeros((T,), jnp.int32).at[run_start].add(1)  # at each run's first token
    starts = (t == run_start) & (run_len >= min_queries) & (positions > 0)
    ctx = jnp.zeros((num_rows,), jnp.int32).at[seq_ids].max(jnp.where(starts, positions, 0).astype(jnp.int32))
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(ctx, dtype=jnp.int32)])
    return starts[run_start], cu


def gather_window(kv_cache, layer, page_table, cu, start, window: int):
    """The latents [window, R + dr] of flat context keys start .. start + window - 1 (keys past cu[-1] read the
    null page's slot 0: masked by the block ranges, never attended)."""
    S, page_size = page_table.shape[0], kv_cache.shape[2]
    j = start + jnp.arange(window, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(cu, j, side="right") - 1, 0, S - 1)
    pos = jnp.where(j < cu[-1], j - cu[row], 0)
    page = jnp.where(j < cu[-1], page_table[row, pos // page_size], 0)
    return kv_cache[layer, page, pos % page_size]


def _kernel(first_ref, count_ref, lo_ref, hi_ref, qn_ref, qp_ref, kv_ref, kpe_ref, acc_in, m_in, l_in,
            acc_ref, m_ref, l_ref, *, block_q, block_k, dn, dv, num_tokens, window, scale):
    del acc_in, m_in, l_in  # aliased to acc_ref, m_ref, l_ref
    b, h = pl.program_id(0), pl.program_id(1)
    first, count, k_lo, k_hi = first_ref[b], count_ref[b], lo_ref[b], hi_ref[b]

    @pl.when((count > 0) & (k_hi > k_lo))
    def _():
        q0 = jnp.minimum(first, num_tokens - block_q)  # in-bounds window holding the block
        qn = qn_ref[pl.ds(q0, block_q), h, :]  # [bq, dn]
        qp = qp_ref[pl.ds(q0, block_q), h, :]  # [bq, dr]
        qi = q0 + jnp.arange(block_q)
        mine = (qi >= first) & (qi < first + count)

        def body(j, carry):
            lo = k_lo + j * block_k
            k0 = jnp.minimum(lo, window - block_k)
            ki = k0 + jnp.arange(block_k)
            s, v = key_block(qn, qp, kv_ref, kpe_ref, h, k0, block_k, dn, dv)
            ok = (ki[None, :] >= lo) & (ki[None, :] < k_hi)
            return softmax_step(jnp.where(ok, s * scale, NEG), v, carry)

        init = (acc_ref[pl.ds(q0, block_q), h, :], m_ref[pl.ds(q0, block_q), h], l_ref[pl.ds(q0, block_q), h])
        acc, m, l = jax.lax.fori_loop(0, (k_hi - k_lo + block_k - 1) // block_k, body, init)
        plgpu.store(acc_ref.at[pl.ds(q0, block_q), h, :], acc, mask=jnp.broadcast_to(mine[:, None], acc.shape))
        plgpu.store(m_ref.at[pl.ds(q0, block_q), h], m, mask=mine)
        plgpu.store(l_ref.at[pl.ds(q0, block_q), h], l, mask=mine)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "num_warps", "num_stages", "interpret"))
def window_attention(q_nope, q_pe, kv, k_pe, blocks, k_lo, k_hi, scale, acc, m, l, *, block_q, block_k=64,
                     num_warps=4, num_stages=2, interpret=False):
    """One window: q_nope [T, H, dn], q_pe [T, H, dr] (roped); kv [W, H, dn + dv], k_pe [W, dr] the window's
    up-projected keys; blocks = (first, count) of `mla_prefill.query_blocks`; block b attends keys
    k_lo[b] .. k_hi[b] - 1 of the window. (acc [T, H, dv] fp32, m, l [T, H]) -> the same, continued."""
    T, H, dn = q_nope.shape
    W, dv = kv.shape[0], kv.shape[-1] - dn
    first, count = (x.astype(jnp.int32) for x in blocks)
    stages = num_stages if q_nope.dtype.itemsize < 4 else 1
    kernel = functools.partial(_kernel, block_q=block_q, block_k=min(block_k, W), dn=dn, dv=dv, num_tokens=T,
                               window=W, scale=scale)
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (acc, m, l)]
    return pl.pallas_call(kernel, grid=(first.shape[0], H), out_shape=out_shape,
                          input_output_aliases={8: 0, 9: 1, 10: 2},
                          compiler_params=compiler_params(num_warps, stages, interpret), interpret=interpret)(
        first, count, k_lo.astype(jnp.int32), k_hi.astype(jnp.int32), q_nope, q_pe, kv, k_pe, acc, m, l)


def block_ranges(seq_ids, picked, cu, blocks, start, window: int):
    """Each block's keys in the window starting at flat key `start`: [k_lo, k_hi) of its sequence's picked
    context, empty for blocks of runs not picked (and for the count-0 entries past the real blocks)."""
    T = seq_ids.shape[0]
    first = jnp.minimum(blocks[0], T - 1)
    s = seq_ids[first]
    on = picked[first] & (blocks[1] > 0)
    k_lo = jnp.where(on, jnp.clip(cu[s] - start, 0, window), 0)
    k_hi = jnp.where(on, jnp.clip(cu[s + 1] - start, 0, window), 0)
    return k_lo, k_hi


def expanded_context(q_nope, q_pe, kv_cache, layer, page_table, seq_ids, picked, cu, blocks, up_project, scale,
                     state, *, block_q, window, interpret=False):
    """The picked runs' context part, continued from `state` = (acc, m, l) (the chunk part's): window after
    window of the laid-out contexts (a loop of cu[-1] / window rounds, none when nothing is picked).
    `up_project`: c_kv [W, R] -> [W, H, dn + dv] in q's dtype (kv_b_proj). -> (acc, m, l)."""
    R = kv_cache.shape[-1] - q_pe.shape[-1]

    def body(i, st):
        start = i * window
        lat = gather_window(kv_cache, layer, page_table, cu, start, window).astype(q_nope.dtype)
        k_lo, k_hi = block_ranges(seq_ids, picked, cu, blocks, start, window)
        return window_attention(q_nope, q_pe, up_project(lat[:, :R]), lat[:, R:], blocks, k_lo, k_hi, scale, *st,
                                block_q=block_q, interpret=interpret)

    return jax.lax.fori_loop(0, (cu[-1] + window - 1) // window, body, state)


def expanded_context_reference(q_nope, q_pe, kv_cache, layer, page_table, seq_ids, positions, picked, up_project,
                               scale, state):
    """Pure JAX, fp32: each picked token t continues `state` with keys 0 .. p - 1 of its sequence, p the first
    position of its run (its context); other rows unchanged."""
    from deepinfer_jax.kernels.mla_prefill import run_starts

    f32 = jnp.float32
    T, H, dn = q_nope.shape
    S, P = page_table.shape
    page_size = kv_cache.shape[2]
    R = kv_cache.shape[-1] - q_pe.shape[-1]
    lat = kv_cache[layer, page_table].reshape(S, P * page_size, -1).astype(q_nope.dtype)  # [S, L, R + dr]
    kv = jnp.stack([up_project(lat[s, :, :R]) for s in range(S)]).astype(f32)  # [S, L, H, dn + dv]
    kv, kp = kv[seq_ids], lat[seq_ids, :, R:].astype(f32)  # [T, L, ...]
    s = jnp.einsum("thd,tkhd->thk", q_nope.astype(f32), kv[..., :dn], precision=EXACT)
    s = s + jnp.einsum("thd,tkd->thk", q_pe.astype(f32), kp, precision=EXACT)
    ctx = positions[run_starts(seq_ids, positions)]
    ok = picked[:, None] & (jnp.arange(P * page_size)[None, :] < ctx[:, None])  # [T, L]
    s = jnp.where(ok[:, None, :], s * scale, NEG)
    acc0, m0, l0 = state
    m = jnp.maximum(m0, s.max(axis=-1))  # [T, H]
    p = jnp.exp(s - m[..., None])
    corr = jnp.exp(m0 - m)
    acc = acc0 * corr[..., None] + jnp.einsum("thk,tkhv->thv", p, kv[..., dn:], precision=EXACT)
    return acc, m, l0 * corr + p.sum(axis=-1)
