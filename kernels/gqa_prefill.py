"""Ragged grouped-query attention for prefill-size steps in Pallas (Triton backend), flash-attention style.

Semantics are `gqa_reference.paged_gqa_attention_reference`, for a step whose sequences' tokens are contiguous
(runner/inputs.py `build_metadata` lays each sequence row's tokens out as one run; padding tokens, sequence row 0
at position 0, form a run at the end).

Query blocks (`query_blocks`): the step's tokens are cut into blocks of at most `block_q` consecutive tokens of one
sequence row: a block starts where the row changes or `block_q` tokens of the run have been taken. A step of T
tokens over S sequence rows has at most T // block_q + S + 1 of them (`max_blocks`); unused blocks hold no token
and do no work. They are the same for every layer of a step: `query_block_layout` lays them out once.

A program (block, KV head) reads q [T, H, hd] in place: a tile of block_q tokens x Gp query heads (G padded to a
power of two), rows in token-major order [block_q * Gp, hd]. The tile starts at the block's first token and its
KV head's first query head, moved back where it would pass the end of q (at most T - block_q, H - Gp: so T >=
block_q and H >= Gp, `applies`); the block's tokens and the KV head's G heads are the tile's valid rows, the others
are computed and dropped. The program walks its sequence's key blocks through the page table once, from the first
key any valid row sees to the last (their largest position), each K / V tile [block_keys, hd] read once for all
the rows and masked per row to keys <= the row's position (and inside its window). fp32 online softmax
(kernels/mla_decode.py `softmax_step`; a row's own key is always in the walk, so every valid row sees a key),
normalized in the kernel: one pass, no context splits. It stores its valid rows in place into the output [T, H,
hd] (a masked store); every token is in one block, so every row of the output is written once. Neither q nor the
output is copied into or out of a block layout (a transpose and a gather, 10 ms of Llama-3.1-8B's 16,384-token
prefill on an H100).

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
from jax.experimental.pallas import triton as plgpu

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
    """seq_ids [T] -> (start [NB] each block's first token (T where empty), count [NB] its tokens, seq [NB] its
    sequence row). Invariant: at most `num_blocks` blocks (`max_blocks` for contiguous sequence rows)."""
    T = seq_ids.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    new_run = jnp.concatenate([jnp.ones((1,), bool), seq_ids[1:] != seq_ids[:-1]])
    run_start = jax.lax.cummax(jnp.where(new_run, t, 0))
    first = new_run | ((t - run_start) % block_q == 0)
    blk = jnp.cumsum(first.astype(jnp.int32)) - 1  # each token's block
    start = jnp.full((num_blocks,), T, jnp.int32).at[jnp.where(first, blk, num_blocks)].set(t, mode="drop")
    count = jnp.zeros((num_blocks,), jnp.int32).at[blk].add(1, mode="drop")
    seq = jnp.zeros((num_blocks,), jnp.int32).at[blk].set(seq_ids.astype(jnp.int32), mode="drop")
    return start, count, seq


class QueryBlocks(NamedTuple):
    """A step's query blocks (`query_block_layout`), the same for every layer: start [NB], count [NB], seq [NB]
    (`query_blocks`)."""

    start: jax.Array
    count: jax.Array
    seq: jax.Array


def _tile(groups: int, rows: int) -> tuple[int, int]:
    """(Gp, block_q): G padded to a power of two, and the tokens a block of `rows` query rows holds (at least one)."""
    gp = 1 << (groups - 1).bit_length()
    return gp, max(1, rows // gp)


def applies(num_tokens: int, num_heads: int, groups: int, rows: int = ROWS) -> bool:
    """Whether a step of `num_tokens` token slots with `num_heads` query heads, `groups` a KV head, takes the kernel:
    a program's tile of block_q tokens and Gp heads must lie inside q [T, H, hd] (the module docstring)."""
    gp, block_q = _tile(groups, rows)
    return num_tokens >= block_q and num_heads >= gp and block_q * gp >= 16


def query_block_layout(seq_ids: jax.Array, num_seq_rows: int, groups: int, rows: int = ROWS) -> QueryBlocks:
    """The query blocks of a step of tokens seq_ids [T] over `num_seq_rows` sequence rows, for G = `groups` query
    heads a KV head: what `ragged_gqa_attention` needs besides the layer's q and cache, laid out once a step for all
    its layers."""
    _, block_q = _tile(groups, rows)
    return QueryBlocks(*query_blocks(seq_ids, block_q, max_blocks(seq_ids.shape[0], num_seq_rows, block_q)))


def _kernel(layer_ref, seq_ref, start_ref, count_ref, pt_ref, pos_ref, q_ref, kv_ref, o_ref, *,
            page_size, block_keys, groups, heads, block_q, scale, window):
    b, k = pl.program_id(0), pl.program_id(1)
    layer, seq, start, count = layer_ref[0], seq_ref[b], start_ref[b], count_ref[b]
    T, H, hd = q_ref.shape
    rows = block_q * heads
    # The tile: tokens [t0, t0 + block_q) x query heads [h0, h0 + heads) of q [T, H, hd], inside q; the block's
    # tokens and this KV head's query heads are the valid part of it, at offsets dt and dh.
    t0, h0 = jnp.minimum(start, T - block_q), jnp.minimum(k * groups, H - heads)
    dt, dh = start - t0, k * groups - h0
    ti = jax.lax.broadcasted_iota(jnp.int32, (block_q, heads), 0)
    hi = jax.lax.broadcasted_iota(jnp.int32, (block_q, heads), 1)
    valid = (ti >= dt) & (ti < dt + count) & (hi >= dh) & (hi < dh + groups)  # [block_q, heads]
    q = q_ref[pl.ds(t0, block_q), pl.ds(h0, heads), :].reshape(rows, hd)
    pos = jnp.where(valid, pos_ref[pl.ds(t0, block_q)][:, None], -1).reshape(rows)  # -1: a row that sees nothing
    top = jnp.max(pos)
    div = lambda a, d: jax.lax.div(a, jnp.int32(d))  # noqa: E731 - operands >= 0 (jnp // and % failed to lower)
    hi_key = jnp.where(count > 0, div(jnp.maximum(top, 0), block_keys) + 1, 0)
    lo = 0
    if window is not None:
        low = jnp.min(jnp.where(pos >= 0, pos, top))
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

    init = (jnp.zeros((rows, hd), jnp.float32), jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, _, l = jax.lax.fori_loop(lo, jnp.maximum(hi_key, lo), body, init)
    out = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype).reshape(block_q, heads, hd)
    plgpu.store(o_ref.at[pl.ds(t0, block_q), pl.ds(h0, heads), :], out,
                mask=jnp.broadcast_to(valid[:, :, None], out.shape))


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "rows", "block_keys", "num_warps",
                                             "num_stages", "interpret"))
def ragged_gqa_attention(q, kv_cache, layer, seq_ids, positions, page_table, scale, sliding_window=None, *,
                         rows=ROWS, block_keys=None, num_warps=NUM_WARPS, num_stages=NUM_STAGES, interpret=False,
                         blocks: QueryBlocks | None = None):
    """q [T, H, hd] roped, kv_cache [L, P, ps, 2, KVH, hd] (the whole cache), layer int32 scalar -> [T, H, hd] in
    q's dtype. Each sequence row's tokens contiguous (module docstring); `applies(T, H, G, rows)`. `rows`: query
    rows a program holds (block_q = rows // Gp tokens, at least one). `blocks`: the step's `query_block_layout` at
    the same `rows` (None: laid out here)."""
    T, H, hd = q.shape
    _, _, ps, _, KVH, _ = kv_cache.shape
    G = H // KVH
    Gp, block_q = _tile(G, rows)
    assert applies(T, H, G, rows), (T, H, G, rows)
    bk = min(block_keys or BLOCK_KEYS, ps)
    assert ps % bk == 0, (ps, bk)
    if blocks is None:
        blocks = query_block_layout(seq_ids, page_table.shape[0], G, rows)
    start, count, seq = blocks
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    kernel = functools.partial(_kernel, page_size=ps, block_keys=bk, groups=G, heads=Gp, block_q=block_q,
                               scale=scale, window=sliding_window)
    full = lambda a: pl.BlockSpec(a.shape, lambda b, k: (0,) * a.ndim)  # noqa: E731
    stages = num_stages if kv_cache.dtype.itemsize < 4 else 1
    return pl.pallas_call(
        kernel,
        grid=(start.shape[0], KVH),
        in_specs=[full(layer), full(seq), full(start), full(count), full(page_table), full(positions), full(q),
                  full(kv_cache)],
        out_specs=full(q),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compiler_params(num_warps, stages, interpret),
        interpret=interpret,
    )(layer, seq, start, count, page_table, positions.astype(jnp.int32), q, kv_cache)
