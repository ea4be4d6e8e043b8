"""Paged grouped-query attention in Pallas (Triton backend), split over the context (flash-decoding).

Semantics are `gqa_reference.paged_gqa_attention_reference`: each query token t (decode tokens and ragged
prefill-chunk tokens alike) attends with its H query heads to the keys of its own sequence up to its position
(and after positions[t] - sliding_window where a window is set), the G = H / KVH query heads of KV head k
reading that head's keys and values. fp32 online softmax (kernels/mla_decode.py `softmax_step`).

Grid: (token, KV head, context split). A program holds its token's G query heads of one KV head as a row block
(padded to a power of two of at least 16 rows, as the Triton backend's dots need), and walks its share of the
sequence's key blocks (`block_keys` keys, at most a page) through the page table, reading the block's K and V
[block, hd] out of the cache [L, P, page_size, 2, KVH, hd] in place. A token's walk starts at the first block
holding a key it sees (so with a sliding window the first update of every split sees a visible key, the
online softmax's invariant). The splits merge in JAX (`mla_decode.merge_splits`).

`interpret=True` runs the same kernel on the CPU (tests); `supported` says which shapes the GPU takes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.kernels.mla_decode import EXACT, NEG, auto_splits, merge_splits, softmax_step
from deepinfer_jax.kernels.triton_params import compiler_params

BLOCK_KEYS = 32  # keys a program reads per loop step, at most a page
GQA_MAX_SPLITS = 16  # auto_splits' cap here: each split is KVH programs a token (8 for Llama-3.1-8B)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(head_dim: int, page_size: int, interpret: bool = False) -> bool:
    """Shapes the kernel compiles for on the GPU: a power-of-two head_dim and page of at least 16 (Triton's
    dots); any shape in interpret mode."""
    return interpret or (_pow2(head_dim) and head_dim >= 16 and _pow2(page_size) and page_size >= 16)


def _kernel(layer_ref, pps_ref, seq_ref, pos_ref, pt_ref, q_ref, kv_ref, o_ref, m_ref, l_ref, *,
            page_size, block_keys, scale, window):
    t, k, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, seq, pos, pps = layer_ref[0], seq_ref[t], pos_ref[t], pps_ref[0]
    n_blocks = pos // block_keys + 1  # blocks holding keys 0..pos
    lo = 0 if window is None else jnp.maximum(pos - window + 1, 0) // block_keys
    first = jnp.maximum(sp * pps, lo)
    last = jnp.minimum(sp * pps + pps, n_blocks)
    q = q_ref[0, 0]  # [rows, hd]
    rows, hd = q.shape
    per_page = page_size // block_keys
    lowest = -1 if window is None else pos - window  # keys at or below it are out of the window

    def body(i, carry):
        page = pt_ref[seq, i // per_page]
        keys = pl.ds((i % per_page) * block_keys, block_keys)
        kb = kv_ref[layer, page, keys, 0, k, :]  # [block, hd]
        vb = kv_ref[layer, page, keys, 1, k, :]
        s = jnp.dot(q, kb.T, preferred_element_type=jnp.float32, precision=EXACT) * scale  # [rows, block]
        key_pos = i * block_keys + jnp.arange(block_keys)
        visible = (key_pos <= pos) & (key_pos > lowest)
        return softmax_step(jnp.where(visible[None, :], s, NEG), vb, carry)

    init = (jnp.zeros((rows, hd), jnp.float32), jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(first, jnp.maximum(last, first), body, init)
    o_ref[0, 0, 0] = acc
    m_ref[0, 0, 0] = m
    l_ref[0, 0, 0] = l


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "num_splits", "block_keys", "num_warps",
                                             "num_stages", "interpret"))
def paged_gqa_attention(q, kv_cache, layer, seq_ids, positions, page_table, scale, sliding_window=None, *,
                        num_splits=None, block_keys=None, num_warps=4, num_stages=2, interpret=False):
    """q [T, H, hd] roped, kv_cache [L, P, ps, 2, KVH, hd] (the whole cache), layer int32 scalar -> [T, H, hd] in
    q's dtype. num_splits None: mla_decode.auto_splits(T, cap=GQA_MAX_SPLITS) (a step has KVH times MLA's programs a
    split)."""
    T, H, hd = q.shape
    _, _, ps, _, KVH, _ = kv_cache.shape
    G = H // KVH
    rows = max(16, 1 << (G - 1).bit_length())  # the row block: G padded to a power of two >= 16
    bk = block_keys or min(BLOCK_KEYS, ps)
    assert ps % bk == 0, (ps, bk)
    splits = max(1, min(auto_splits(T, GQA_MAX_SPLITS) if num_splits is None else num_splits,
                        page_table.shape[1] * (ps // bk)))
    longest = jnp.max(positions) // bk + 1
    pps = ((longest + splits - 1) // splits).astype(jnp.int32).reshape(1)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    qg = jnp.pad(q.reshape(T, KVH, G, hd), ((0, 0), (0, 0), (0, rows - G), (0, 0)))  # [T, KVH, rows, hd]
    kernel = functools.partial(_kernel, page_size=ps, block_keys=bk, scale=scale, window=sliding_window)
    full = lambda a: pl.BlockSpec(a.shape, lambda t, k, s: (0,) * a.ndim)  # noqa: E731
    stages = num_stages if kv_cache.dtype.itemsize < 4 else 1
    o, m, l = pl.pallas_call(
        kernel,
        grid=(T, KVH, splits),
        in_specs=[full(layer), full(pps), full(seq_ids), full(positions), full(page_table),
                  pl.BlockSpec((1, 1, rows, hd), lambda t, k, s: (t, k, 0, 0)), full(kv_cache)],
        out_specs=[pl.BlockSpec((1, 1, 1, rows, hd), lambda t, k, s: (t, k, s, 0, 0)),
                   pl.BlockSpec((1, 1, 1, rows), lambda t, k, s: (t, k, s, 0)),
                   pl.BlockSpec((1, 1, 1, rows), lambda t, k, s: (t, k, s, 0))],
        out_shape=(jax.ShapeDtypeStruct((T, KVH, splits, rows, hd), jnp.float32),
                   jax.ShapeDtypeStruct((T, KVH, splits, rows), jnp.float32),
                   jax.ShapeDtypeStruct((T, KVH, splits, rows), jnp.float32)),
        compiler_params=compiler_params(num_warps, stages, interpret),
        interpret=interpret,
    )(layer, pps, seq_ids, positions, page_table, qg, kv_cache)
    out = merge_splits(o, m, l).reshape(T, KVH, rows, hd)[:, :, :G]  # padded rows dropped
    return out.reshape(T, H, hd).astype(q.dtype)
