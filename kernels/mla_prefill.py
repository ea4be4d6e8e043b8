"""Paged MLA attention (absorbed form) for prefill / chunked prefill, in Pallas (Triton backend).

Semantics are `mla_reference.paged_mla_attention_reference`, exactly as for `mla_decode`: token t
attends (MQA of its H absorbed query heads against one 576-wide latent key per position, 512-wide
latent values, fp32 online softmax) to keys 0..positions[t] of sequence row seq_ids[t]. The decode
kernel runs one program per (token, head block), so a prefill chunk of n tokens reads its sequence's
pages n times; this kernel reads them once per block of `block_q` tokens.

Query blocks. A *run* is a maximal stretch of consecutive flattened tokens with the same seq_id and
non-decreasing positions (a new run starts where seq_ids changes or positions decreases, so padding
tokens, row 0 at position 0, after a real row-0 chunk start a run of their own). Each run is cut into
blocks of `block_q` tokens. The block table (first token, token count) is built on the device by
`query_blocks` with a static number of entries NB = T // block_q + S + 1 (S = page_table rows), which
bounds the block count whenever each sequence row's tokens are one run and padding is one run at the
tail (how runner/inputs.py lays out a step: at most S + 1 runs, and a run of n tokens gives at most
n // block_q + 1 blocks). Entries past the real block count have count 0 and their programs exit at
once (`pl.when`).

Program = (query block, head block, context split). Its query tile is block_q tokens x block_h heads
= rows, laid out by the wrapper as one contiguous 2-D [rows, R] slab ([nh, T * block_h, R], a free
reshape when nh == 1). The tile is read from a window of block_q tokens starting at
min(first, T - block_q), so every load is in bounds; rows of the window outside the block belong to
other blocks and are never stored (masked store). The program walks pages 0 .. (last position of
the block) // page_size of the block's sequence once (the last token of a run has its largest
position), each page as the two power-of-two slices c_kv [ps, 512] and k_pe [ps, 64], masking per
row key_pos <= that row's position (per-row positions come from a [T * block_h] array built in the
wrapper). With num_splits > 1 the pages are split flash-decoding style and the partial results merged
in JAX with log-sum-exp rescaling; with num_splits == 1 (default) the kernel normalises and stores
the output in q's dtype directly.

Tile size (timed on an H200, benchmarks/RESULTS.md; R = 512, dr = 64, page 64, bf16): block_q = 4 x
block_h = 16 = 64 rows at 8 warps and 2 stages is the default: 723 us for 16 fresh prompts of 512
tokens, against 947 us at block_q 2, 1,200 us at block_q 1 and 1,233 us through the decode kernel.
(Compiled offline for sm_90a, 64 rows hold a 64 x 512 fp32 accumulator at the register limit with some
spills; it is still the fastest.) fp32 operands on a GPU use block_q 1 and one stage: their pages and
tiles are twice the bytes and would exceed the 227 KB of shared memory.

Invariants: all rows of one block share a sequence; pages unused by a sequence point at the null page;
masked scores use a finite large negative, and with the default `visible_to` (each token's own
position) key 0 is visible to every row, so no row divides by zero; with an earlier `visible_to`
(`return_lse`, the context-only pass of `mla_chunk`) a row may see no key and gets o = 0, l = 0.
Every token belongs to exactly one block, so every output row is written exactly once.

`interpret=True` runs the same kernel on the CPU (tests); the reference defines correctness.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from deepinfer_jax.kernels.mla_decode import NEG, attend_page
from deepinfer_jax.kernels.triton_params import compiler_params


def num_query_blocks_bound(num_tokens: int, num_seq_rows: int, block_q: int) -> int:
    """The static number of block-table entries: T // block_q + S + 1."""
    return num_tokens // block_q + num_seq_rows + 1


def run_starts(seq_ids: jax.Array, positions: jax.Array) -> jax.Array:
    """[T] int32: the index of the first token of each token's run (consecutive slots of one seq_id
    with rising positions: a sequence's chunk in this step)."""
    T = seq_ids.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    new_run = jnp.concatenate(
        [jnp.ones((1,), bool), (seq_ids[1:] != seq_ids[:-1]) | (positions[1:] < positions[:-1])])
    return jax.lax.cummax(jnp.where(new_run, t, 0))


def query_blocks(seq_ids: jax.Array, positions: jax.Array, block_q: int, num_blocks: int):
    """-> (first [NB] int32, count [NB] int32): the query blocks in token order (see the module
    docstring); entries past the real block count have first = T and count = 0. If the step has
    more than `num_blocks` blocks the extra ones are dropped (the layout invariant rules that out)."""
    T = seq_ids.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    run_start = run_starts(seq_ids, positions)
    starts = (t - run_start) % block_q == 0
    (first,) = jnp.nonzero(starts, size=num_blocks, fill_value=T)
    first = first.astype(jnp.int32)
    nxt = jnp.concatenate([first[1:], jnp.full((1,), T, jnp.int32)])
    return first, (nxt - first).astype(jnp.int32)


def _kernel(layer_ref, first_ref, count_ref, seq_ref, rpos_ref, pt_ref, ql_ref, qp_ref, kv_ref,
            *out_refs, page_size, pages_per_split, block_q, block_h, num_tokens, rank, scale, split, lse):
    """Outputs: o (normalised, q's dtype); or with `split` the fp32 accumulator, max and sum of each
    split; or with `lse` (one split) o normalised plus its max and sum, where a block that sees no key
    at all (a fresh chunk in the context-only pass) skips its loads and writes o = 0, m = NEG, l = 0."""
    b, h, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first, count = first_ref[b], count_ref[b]

    @pl.when(count > 0)
    def _():
        layer = layer_ref[0]
        seq = seq_ref[first]
        # The block's last visible key (its last row's; positions rise within a run); -1: none.
        last_visible = rpos_ref[(first + count - 1) * block_h]
        n_pages = jnp.where(last_visible >= 0, last_visible // page_size + 1, 0)
        lo = sp * pages_per_split
        hi = jnp.minimum(lo + pages_per_split, n_pages)
        rows = block_q * block_h
        r0 = jnp.minimum(first, num_tokens - block_q) * block_h  # in-bounds window holding the block
        grow = r0 + jnp.arange(rows)
        mine = (grow >= first * block_h) & (grow < (first + count) * block_h)  # rows of this block
        mask2 = jnp.broadcast_to(mine[:, None], (rows, rank))

        def attend():
            q_lat = ql_ref[h, pl.ds(r0, rows), :]  # [rows, R]
            q_pe = qp_ref[h, pl.ds(r0, rows), :]  # [rows, dr]
            row_pos = rpos_ref[pl.ds(r0, rows)]  # [rows]

            def body(i, carry):
                return attend_page(q_lat, q_pe, kv_ref, layer, pt_ref[seq, i], i, row_pos[:, None], carry,
                                   page_size=page_size, rank=rank, scale=scale)

            init = (jnp.zeros((rows, rank), jnp.float32), jnp.full((rows,), NEG, jnp.float32),
                    jnp.zeros((rows,), jnp.float32))
            return jax.lax.fori_loop(lo, jnp.maximum(hi, lo), body, init)

        if lse:
            o_ref, m_ref, l_ref = out_refs

            def store(o, m, l):
                plgpu.store(o_ref.at[h, pl.ds(r0, rows), :], o.astype(o_ref.dtype), mask=mask2)
                plgpu.store(m_ref.at[h, pl.ds(r0, rows)], m, mask=mine)
                plgpu.store(l_ref.at[h, pl.ds(r0, rows)], l, mask=mine)

            @pl.when(hi > lo)
            def _():
                acc, m, l = attend()
                store(acc / jnp.maximum(l, 1e-30)[:, None], m, l)

            @pl.when(hi <= lo)
            def _():
                store(jnp.zeros((rows, rank), jnp.float32), jnp.full((rows,), NEG, jnp.float32),
                      jnp.zeros((rows,), jnp.float32))
            return
        acc, m, l = attend()
        if not split:
            (o_ref,) = out_refs
            o = (acc / l[:, None]).astype(o_ref.dtype)
            plgpu.store(o_ref.at[h, pl.ds(r0, rows), :], o, mask=mask2)
        else:
            o_ref, m_ref, l_ref = out_refs
            plgpu.store(o_ref.at[sp, h, pl.ds(r0, rows), :], acc, mask=mask2)
            plgpu.store(m_ref.at[sp, h, pl.ds(r0, rows)], m, mask=mine)
            plgpu.store(l_ref.at[sp, h, pl.ds(r0, rows)], l, mask=mine)


def effective_block_q(num_tokens: int, block_q: int) -> int:
    """block_q capped at the largest power of two <= T (the query window must fit in the step)."""
    return min(block_q, 1 << (max(1, num_tokens).bit_length() - 1))


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_h", "num_splits", "num_warps",
                                             "num_stages", "interpret", "return_lse"))
def paged_mla_prefill_attention(q_lat, q_pe, kv_cache, layer, seq_ids, positions, page_table, scale, *,
                                block_q=4, block_h=16, num_splits=1, num_warps=8, num_stages=2,
                                interpret=False, blocks=None, visible_to=None, return_lse=False):
    """Defaults from the H200 sweep (benchmarks/RESULTS.md): block_q 4 x 16 heads = 64 rows took 723 us
    for 16 x 512 fresh tokens vs 947 us at block_q 2 and 1,233 us through the decode kernel.

    q_lat [T, H, R], q_pe [T, H, dr], kv_cache [L, P, ps, R + dr] (the whole cache: slicing a layer
    out would copy it), layer: int32 scalar, seq_ids / positions [T] int32, page_table [S, max_pages]
    int32 -> o_lat [T, H, R] (q_lat's dtype). block_q and block_h must be powers of two; block_h
    (capped at H) must divide H; block_q is capped at `effective_block_q(T, block_q)`.

    blocks: optionally the block table (first, count) from `query_blocks` with that effective block_q,
    e.g. built once per step and shared by the layers; any order and length (one program per entry).

    visible_to [T] int32 (default: positions): the last key position each token sees; -1 for none
    (e.g. `mla_chunk`'s split: each token against the cached context before its chunk only).
    return_lse: -> (o [T, H, R], m [T, H], l [T, H]), o normalised (0 for a row that saw no key), m
    the row's max score and l its sum of exp(score - m), for merging with another key set."""
    T, H, R = q_lat.shape
    _, _, ps, _ = kv_cache.shape
    S, max_pages = page_table.shape
    assert block_q & (block_q - 1) == 0 and block_h & (block_h - 1) == 0, (block_q, block_h)
    if q_lat.dtype.itemsize >= 4 and not interpret:  # fp32 on a GPU: 16-row blocks fit in shared memory
        block_q = 1
    bq = effective_block_q(T, block_q)
    bh = min(block_h, H)
    assert H % bh == 0, (H, bh)
    nh = H // bh
    splits = max(1, min(num_splits, max_pages))
    pps = math.ceil(max_pages / splits)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    seq_ids = seq_ids.astype(jnp.int32)
    positions = positions.astype(jnp.int32)
    if blocks is None:
        blocks = query_blocks(seq_ids, positions, bq, num_query_blocks_bound(T, S, bq))
    first, count = (b.astype(jnp.int32) for b in blocks)
    nb = first.shape[0]
    row_pos = jnp.repeat(positions if visible_to is None else visible_to.astype(jnp.int32), bh)  # [T * bh]
    # [T, H, X] -> [nh, T * bh, X]: a block's rows (bq tokens x bh heads) are one contiguous slab.
    to_rows = lambda x: x.reshape(T, nh, bh, -1).transpose(1, 0, 2, 3).reshape(nh, T * bh, -1)  # noqa: E731
    ql, qp = to_rows(q_lat), to_rows(q_pe)
    kernel = functools.partial(_kernel, page_size=ps, pages_per_split=pps, block_q=bq, block_h=bh,
                               num_tokens=T, rank=R, scale=scale, split=splits > 1,
                               lse=return_lse and splits == 1)
    if splits == 1 and return_lse:
        out_shape = [jax.ShapeDtypeStruct((nh, T * bh, R), q_lat.dtype),
                     jax.ShapeDtypeStruct((nh, T * bh), jnp.float32), jax.ShapeDtypeStruct((nh, T * bh), jnp.float32)]
    elif splits == 1:
        out_shape = [jax.ShapeDtypeStruct((nh, T * bh, R), q_lat.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((splits, nh, T * bh, R), jnp.float32),
                     jax.ShapeDtypeStruct((splits, nh, T * bh), jnp.float32),
                     jax.ShapeDtypeStruct((splits, nh, T * bh), jnp.float32)]
    # A page of fp32 latents is 147 KB: two pipeline stages would exceed the 227 KB of shared memory.
    stages = num_stages if kv_cache.dtype.itemsize < 4 else 1
    params = compiler_params(num_warps, stages, interpret)
    outs = pl.pallas_call(
        kernel,
        grid=(nb, nh, splits),
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret,
    )(layer, first, count, seq_ids, row_pos, page_table.astype(jnp.int32), ql, qp, kv_cache)
    def to_heads(x):  # [nh, T * bh, ...] -> [T, H, ...]
        x = x.reshape(nh, T, bh, *x.shape[2:])
        return jnp.moveaxis(x, 0, 1).reshape(T, H, *x.shape[3:])

    if splits == 1:
        return tuple(map(to_heads, outs)) if return_lse else to_heads(outs[0]).astype(q_lat.dtype)
    # Merge the splits: o = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s.
    acc, m, l = outs
    M = m.max(axis=0)  # [nh, rows]
    w = jnp.exp(m - M[None])  # [splits, nh, rows]; empty splits weigh 0
    L = jnp.sum(w * l, axis=0)
    o = jnp.sum(w[..., None] * acc, axis=0) / jnp.maximum(L, 1e-30)[..., None]  # a reduction, not a dot
    o = to_heads(o).astype(q_lat.dtype)
    return (o, to_heads(M), to_heads(L)) if return_lse else o
