"""Pure-JAX reference for DeepSeek Sparse Attention (V3.2) over the paged cache: the lightning indexer's
scores and top-k selection, and absorbed MLA over the selected keys only (the semantics kernels match).

Per token l the cache entry is [c_kv (R), k_pe (dr), index key (Di)] (models/cache.py). For a query t with
indexer queries iq[t] [Hi, Di] and per-head weights iw[t] [Hi] (fp32, the softmax scale folded in):

    index[t, l]  = sum_h iw[t, h] * relu(iq[t, h] . ik[l])                         (fp32)
    selected[t]  = the index_topk visible keys (l <= positions[t]) of highest index score; every visible
                   key when there are at most index_topk (HF transformers' and DeepSeek's top-k)
    o_lat[t, h]  = sum over selected l of softmax(score[t, h, l]) * c_kv[l]        (as mla_reference)

Selection is `lax.top_k`'s: exactly min(index_topk, visible) keys, ties at the threshold broken towards the
earlier key (HF's torch top-k may break such a tie otherwise; random float scores do not tie). The paged
form gathers the selected entries and attends over them only, as a sparse kernel does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_VALUE = -1e30


def index_scores(iq: jax.Array, iw: jax.Array, ik: jax.Array) -> jax.Array:
    """iq [..., S, Hi, Di], iw [..., S, Hi], ik [..., K, Di] -> [..., S, K] fp32 index scores."""
    s = jnp.einsum("...shd,...kd->...shk", iq, ik, preferred_element_type=jnp.float32)
    return jnp.einsum("...sh,...shk->...sk", iw.astype(jnp.float32), jax.nn.relu(s))


def topk_indices(scores: jax.Array, visible: jax.Array, topk: int) -> tuple[jax.Array, jax.Array]:
    """scores [..., K] fp32, visible [..., K] bool -> (idx [..., k] int32, valid [..., k] bool), k = min(topk, K):
    the keys of the k highest visible scores; `valid` False for slots past the visible keys (fewer than k)."""
    k = min(topk, scores.shape[-1])
    _, idx = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), k)
    return idx, jnp.take_along_axis(visible, idx, axis=-1)


def topk_mask(scores: jax.Array, visible: jax.Array, topk: int) -> jax.Array:
    """scores [..., K] fp32, visible [..., K] bool -> bool [..., K]: the selected keys (topk_indices) as a mask."""
    K = scores.shape[-1]
    if topk >= K:
        return visible
    idx, valid = topk_indices(scores, visible, topk)
    lead = scores.shape[:-1]
    scatter = jax.vmap(lambda i, v: jnp.zeros((K,), bool).at[i].set(v))
    return scatter(idx.reshape(-1, idx.shape[-1]), valid.reshape(-1, idx.shape[-1])).reshape(*lead, K)


def paged_dsa_attention_reference(
    q_lat: jax.Array,  # [T, H, R]   query folded through W_UK
    q_pe: jax.Array,  # [T, H, dr]  roped query part
    iq: jax.Array,  # [T, Hi, Di] the indexer's roped queries
    iw: jax.Array,  # [T, Hi] fp32 the indexer's head weights (softmax scale folded in)
    kv_cache: jax.Array,  # [L, P, page_size, R + dr + Di] the whole cache
    layer: jax.Array,  # int32 scalar: which layer to read
    seq_ids: jax.Array,  # [T] int32, index into page_table
    positions: jax.Array,  # [T] int32, absolute position of each token
    page_table: jax.Array,  # [S, max_pages] int32
    scale: float,
    rope_dim: int,
    index_topk: int,
    token_block: int = 128,
) -> jax.Array:  # [T, H, R] in q_lat's dtype
    T, H, R = q_lat.shape
    _, _, page_size, width = kv_cache.shape
    max_len = page_table.shape[1] * page_size
    lat_end = R + rope_dim

    def block(args):
        ql, qp, qi, wi, sid, pos = args  # [B, H, R], [B, H, dr], [B, Hi, Di], [B, Hi], [B], [B]
        kv = kv_cache[layer, page_table[sid]].reshape(sid.shape[0], max_len, width)  # [B, L, width]
        visible = jnp.arange(max_len)[None, :] <= pos[:, None]  # [B, L]
        scores = index_scores(qi[:, None], wi[:, None], kv[..., lat_end:])[:, 0]  # [B, L]
        idx, valid = topk_indices(scores, visible, index_topk)  # [B, k]
        sel = jnp.take_along_axis(kv[..., :lat_end], idx[..., None], axis=1)  # [B, k, R + dr]
        s = jnp.einsum("bhr,blr->bhl", ql, sel[..., :R], preferred_element_type=jnp.float32)
        s = s + jnp.einsum("bhd,bld->bhl", qp, sel[..., R:], preferred_element_type=jnp.float32)
        s = jnp.where(valid[:, None, :], s * scale, MASK_VALUE)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhl,blr->bhr", p.astype(kv.dtype), sel[..., :R], preferred_element_type=jnp.float32)
        return o.astype(q_lat.dtype)

    args = (q_lat, q_pe, iq, iw, seq_ids, positions)
    if T <= token_block or T % token_block:
        return block(args)
    nb = T // token_block
    split = lambda x: x.reshape(nb, token_block, *x.shape[1:])  # noqa: E731  [T, ...] -> [nb, blk, ...]
    return jax.lax.map(block, tuple(split(a) for a in args)).reshape(T, H, R)
