"""Ragged grouped-query attention for prefill-size steps in Pallas (Triton backend), flash-attention style.

Semantics are `gqa_reference.paged_gqa_attention_reference`, for a step whose sequences' tokens are contiguous
(runner/inputs.py `build_metadata` lays each sequence row's tokens out as one run; padding tokens, sequence row 0
at position 0, form a run at the end).

Query blocks (`query_blocks`): the step's tokens are cut into blocks of at most `block_q` consecutive tokens of one
sequence row: a block starts where the row changes or `block_q` tokens of the run have been taken. A step of T
tokens over S sequence rows has at most T // block_q + S + 1 of them (`max_blocks`); unused blocks hold no token
and do no work. They are the same for every layer of a step: `query_block_layout` lays them out once.

A program (block, KV head) holds its block's tokens' G query heads as a row block [block_q * Gp, hd] (G padded to
a power of two, rows in token-major order) and walks its sequence's key blocks through the page table once, from
the first key any of its rows sees to the last (its largest position), each K / V tile [block_keys, hd] read once
for all the rows and masked per row to keys <= the row's position (and inside its window). fp32 online softmax
(kernels/mla_decode.py `softmax_step`; a row's own key is always in the walk, so every valid row sees a key),
normalized in the kernel: one pass, no context splits. A gather puts the rows back in token order.

Against kernels/gqa_attention.py (a program per token, its G heads padded to 16 rows): a prefill's K / V tiles are
read once per `block_q` tokens instead of once per token, and the tensor cores see `block_q * Gp` real rows.

`interpret=True` runs the same kernel on the CPU (tests); the GPU takes the shapes of kernels/gqa_attention.py
`supported`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.kernels.mla_decode import EXACT, NEG, softmax_step
from deepinfer_jax.kernels.triton_params import compiler_params

# The tile: query rows (tokens x padded heads) a program holds, keys a loop step reads (at most a page), warps and
# pipeline stages. The fastest of six at the 16,384-token step of 32 prompts of 512 with Llama-3.1-8B's heads on an
# H100 (1.36 ms against 1.39-1.75 for the others, 4.40 for the kernel of a token a program; benchmarks/kernels.py
# --only gqa_prefill, results in benchmarks/RESULTS.md).
ROWS, BLOCK_KEYS, NUM_WARPS, NUM_STAGES = 64, 32, 4, 3


def max_blocks(num_tokens: int, num_seq_rows: int, block_q: int) -> int:
    """Query blocks a step of `num_tokens` tokens over `num_seq_rows` sequence rows can need (contiguous rows plus
    a padding run: one partial block a run, and a block per `block_q` tokens), at most one a token."""
    return min(num_tokens, num_tokens // block_q + num_seq_rows + 1)


def query_blocks(seq_ids: jax.Array, block_q: int, num_blocks: int):
    """seq_ids [T] -> (blk [T] each token's block, row [T] its place in the block, start [NB] each block's first
    token (T where empty), count [NB] its tokens, seq [NB] its sequence row). Invariant: at most `num_blocks`
    blocks (`max_blocks` for contiguous sequence rows)."""
    T = seq_ids.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    new_run = jnp.concatenate([jnp.ones((1,), bool), seq_ids[1:] != seq_ids[:-1]])
    run_start = jax.lax.cummax(jnp.where(new_run, t, 0))
    row = (t - run_start) % block_q
    first = new_run | (row == 0)
    blk = jnp.cumsum(first.astype(jnp.int32)) - 1
    start = jnp.full((num_blocks,), T, jnp.int32).at[jnp.where(first, blk, num_blocks)].set(t, mode="drop")
    count = jnp.zeros((num_blocks,), jnp.int32).at[blk].add(1, mode="drop")
    seq = jnp.zeros((num_blocks,), jnp.int32).at[blk].set(seq_ids.astype(jnp.int32), mode="drop")
    return blk, row, start, count, seq


class QueryBlocks(NamedTuple):
    """A step's query blocks (`query_block_layout`), the same for every layer: blk [T], row [T], start [NB],
    count [NB], seq [NB] (`query_blocks`) and row_pos [(T + block_q) * Gp] each query row's position."""

    blk: jax.Array
    row: jax.Array
    start: jax.Array
    count: jax.Array
    seq: jax.Array
    row_pos: jax.Array


def _tile(groups: int, rows: int) -> tuple[int, int]:
    """(Gp, block_q): G padded to a power of two, and the tokens a block of `rows` query rows holds (at least one)."""
    gp = 1 << (groups - 1).bit_length()
    return gp, max(1, rows // gp)


def query_block_layout(seq_ids: jax.Array, positions: jax.Array, num_seq_rows: int, groups: int,
                       rows: int = ROWS) -> QueryBlocks:
    """The query blocks of a step of tokens seq_ids / positions [T] over `num_seq_rows` sequence rows, for G =
    `groups` query heads a KV head: what `ragged_gqa_attention` needs besides the layer's q and cache, laid out once
    a step for all its layers."""
    gp, block_q = _tile(groups, rows)
    nb = max_blocks(seq_ids.shape[0], num_seq_rows, block_q)
    row_pos = jnp.repeat(jnp.pad(positions.astype(jnp.int32), (0, block_q)), gp)
    return QueryBlocks(*query_blocks(seq_ids, block_q, nb), row_pos)


def _kernel(layer_ref, seq_ref, start_ref, count_ref, pt_ref, pos_ref, q_ref, kv_ref, o_ref, *,
            page_size, block_keys, groups, scale, window):
    b, k = pl.program_id(0), pl.program_id(1)
    layer, seq, start, count = layer_ref[0], seq_ref[b], start_ref[b], count_ref[b]
    rows = o_ref.shape[2]
    q = q_ref[k, pl.ds(start * groups, rows), :]  # [rows, hd]
    div = lambda a, d: jax.lax.div(a, jnp.int32(d))  # noqa: E731 - operands >= 0 (jnp // and % failed to lower)
    valid = div(jnp.arange(rows, dtype=jnp.int32), groups) < count
    pos = jnp.where(valid, pos_ref[pl.ds(start * groups, rows)], -1)  # [rows]; -1: a row of no token, sees nothing
    top = jnp.max(pos)
    hi = jnp.where(count > 0, div(jnp.maximum(top, 0), block_keys) + 1, 0)
    lo = 0
    if window is not None:
        low = jnp.min(jnp.where(valid, pos, top))
        lo = div(jnp.maximum(low - window + 1, 0), block_keys)
    per_page = page_size // block_keys

    def body(i, carry):
        page = pt_ref[seq, div(i, per_page)]
        keys = pl.ds((i - div(i, per_page) * per_page) * block_keys, block_keys)
        kb = kv_ref[layer, page, keys, 0, k, :].astype(q.dtype)  # [block, hd]
        vb = kv_ref[layer, page, keys, 1, k, :].astype(q.dtype)
        s = jnp.dot(q, kb.T, preferred_element_type=jnp.float32, precision=EXACT) * scale  # [rows, block]
        key_pos = i * block_keys + jnp.arange(block_keys)
        visible = key_pos[None, :] <= pos[:, None]
        if window is not None:
            visible = visible & (key_pos[None, :] > pos[:, None] - window)
        return softmax_step(jnp.where(visible, s, NEG), vb, carry)

    hd = q.shape[1]
    init = (jnp.zeros((rows, hd), jnp.float32), jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, _, l = jax.lax.fori_loop(lo, jnp.maximum(hi, lo), body, init)
    o_ref[0, 0] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "rows", "block_keys", "num_warps",
                                             "num_stages", "interpret"))
def ragged_gqa_attention(q, kv_cache, layer, seq_ids, positions, page_table, scale, sliding_window=None, *,
                         rows=ROWS, block_keys=None, num_warps=NUM_WARPS, num_stages=NUM_STAGES, interpret=False,
                         blocks: QueryBlocks | None = None):
    """q [T, H, hd] roped, kv_cache [L, P, ps, 2, KVH, hd] (the whole cache), layer int32 scalar -> [T, H, hd] in
    q's dtype. Each sequence row's tokens contiguous (module docstring). `rows`: query rows a program holds
    (block_q = rows // Gp tokens, at least one). `blocks`: the step's `query_block_layout` at the same `rows`
    (None: laid out here)."""
    T, H, hd = q.shape
    _, _, ps, _, KVH, _ = kv_cache.shape
    G = H // KVH
    Gp, block_q = _tile(G, rows)
    rows = block_q * Gp
    bk = min(block_keys or BLOCK_KEYS, ps)
    assert ps % bk == 0, (ps, bk)
    if blocks is None:
        blocks = query_block_layout(seq_ids, positions, page_table.shape[0], G, rows)
    assert blocks.row_pos.shape[0] == (T + block_q) * Gp, "query blocks laid out for another tile"
    blk, row, start, count, seq, row_pos = blocks
    nb = start.shape[0]
    # q as [KVH, (T + block_q) * Gp, hd]: a block's rows are one slice from its first token, whole past the end
    qg = jnp.pad(q.reshape(T, KVH, G, hd), ((0, block_q), (0, 0), (0, Gp - G), (0, 0)))
    qg = qg.transpose(1, 0, 2, 3).reshape(KVH, (T + block_q) * Gp, hd)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    kernel = functools.partial(_kernel, page_size=ps, block_keys=bk, groups=Gp, scale=scale, window=sliding_window)
    full = lambda a: pl.BlockSpec(a.shape, lambda b, k: (0,) * a.ndim)  # noqa: E731
    stages = num_stages if kv_cache.dtype.itemsize < 4 else 1
    out = pl.pallas_call(
        kernel,
        grid=(nb, KVH),
        in_specs=[full(layer), full(seq), full(start), full(count), full(page_table), full(row_pos), full(qg),
                  full(kv_cache)],
        out_specs=pl.BlockSpec((1, 1, rows, hd), lambda b, k: (b, k, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((nb, KVH, rows, hd), q.dtype),
        compiler_params=compiler_params(num_warps, stages, interpret),
        interpret=interpret,
    )(layer, seq, start, count, page_table, row_pos, qg, kv_cache)
    out = out.reshape(nb, KVH, block_q, Gp, hd)[blk, :, row]  # [T, KVH, Gp, hd] back in token order
    return out[:, :, :G].reshape(T, H, hd)
