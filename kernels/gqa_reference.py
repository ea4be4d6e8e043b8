"""Pure-JAX reference for paged grouped-query attention (the semantics every GQA kernel matches).

The dense family's cache (models/dense.py) holds per layer, page and token the roped key and the value of
every KV head: kv_cache[L, P, page_size, 2, KVH, hd] (index 0 of the "2" axis: K, 1: V). Query head h reads
KV head h // (H // KVH) (HF's repeat_kv order):

    score[t, h, l] = q[t, h] . k[l, h // G] * scale          (fp32, G = H // KVH)
    o[t, h]        = sum_l softmax_l(score[t, h, :]) * v[l, h // G]

over the keys l of token t's own sequence with l <= positions[t] (causal; the step's keys and values are
written to the cache before attention), and with a sliding window also l > positions[t] - window. Ragged
batch: each token names its sequence (`seq_ids`) and each sequence its pages (`page_table`). Decode, chunked
prefill and ragged prefill are the same call.

Invariants: pages unused by a sequence are padded with page 0 (the null page); masked scores use a finite
large negative so padding rows never produce NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_VALUE = -1e30


def paged_gqa_attention_reference(
    q: jax.Array,  # [T, H, hd] roped queries
    kv_cache: jax.Array,  # [L, P, page_size, 2, KVH, hd] the whole cache
    layer: jax.Array,  # int32 scalar: which layer to read
    seq_ids: jax.Array,  # [T] int32, index into page_table
    positions: jax.Array,  # [T] int32, absolute position of each token
    page_table: jax.Array,  # [S, max_pages] int32
    scale: float,
    sliding_window: int | None = None,
    token_block: int = 128,
) -> jax.Array:  # [T, H, hd] in q's dtype
    T, H, hd = q.shape
    _, _, page_size, _, KVH, _ = kv_cache.shape
    G = H // KVH
    max_len = page_table.shape[1] * page_size

    def block(args):
        qb, sid, pos = args  # [B, H, hd], [B], [B]
        B = sid.shape[0]
        kv = kv_cache[layer, page_table[sid]].reshape(B, max_len, 2, KVH, hd)  # [B, Lk, 2, KVH, hd]
        qg = qb.reshape(B, KVH, G, hd)
        s = jnp.einsum("bkgd,blkd->bkgl", qg, kv[:, :, 0], preferred_element_type=jnp.float32) * scale
        keys = jnp.arange(max_len)[None, :]
        visible = keys <= pos[:, None]  # [B, Lk]
        if sliding_window is not None:
            visible = visible & (keys > pos[:, None] - sliding_window)
        s = jnp.where(visible[:, None, None, :], s, MASK_VALUE)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bkgl,blkd->bkgd", p.astype(kv.dtype), kv[:, :, 1], preferred_element_type=jnp.float32)
        return o.reshape(B, H, hd).astype(q.dtype)

    if T <= token_block or T % token_block:
        return block((q, seq_ids, positions))
    nb = T // token_block
    split = lambda x: x.reshape(nb, token_block, *x.shape[1:])  # noqa: E731  [T, ...] -> [nb, blk, ...]
    return jax.lax.map(block, (split(q), split(seq_ids), split(positions))).reshape(T, H, hd)
