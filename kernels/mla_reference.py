"""Pure-JAX reference for paged MLA attention in the absorbed form (the semantics every kernel matches).

Absorbed MLA is multi-query attention with one shared 576-wide key per token (the normalised latent
c_kv, kv_lora_rank = 512, then the roped k_pe, 64) and 512-wide values (c_kv itself):

    score[t, h, l] = (q_lat[t, h] . c_kv[l] + q_pe[t, h] . k_pe[l]) * scale      (fp32)
    o_lat[t, h]    = sum_l softmax_l(score[t, h, :]) * c_kv[l]

over the keys l of token t's own sequence with l <= positions[t] (causal; the current step's latents
are written to the cache before attention). Ragged batch: tokens of many sequences are flattened; each
token names its sequence (`seq_ids`) and each sequence its pages (`page_table`).

Invariants: pages unused by a sequence are padded with page 0 (the null page); masked scores use a
finite large negative so padding rows never produce NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_VALUE = -1e30


def paged_mla_attention_reference(
    q_lat: jax.Array,  # [T, H, R]   query folded through W_UK
    q_pe: jax.Array,  # [T, H, dr]  roped query part
    kv_cache: jax.Array,  # [L, P, page_size, R + dr] the whole latent cache
    layer: jax.Array,  # int32 scalar: which layer to read
    seq_ids: jax.Array,  # [T] int32, index into page_table
    positions: jax.Array,  # [T] int32, absolute position of each token
    page_table: jax.Array,  # [S, max_pages] int32
    scale: float,
    token_block: int = 128,
) -> jax.Array:  # [T, H, R] in q_lat's dtype
    T, H, R = q_lat.shape
    _, _, page_size, width = kv_cache.shape
    max_len = page_table.shape[1] * page_size

    def block(args):
        ql, qp, sid, pos = args  # [B, H, R], [B, H, dr], [B], [B]
        kv = kv_cache[layer, page_table[sid]].reshape(sid.shape[0], max_len, width)  # [B, L, R + dr]
        if kv.dtype == jnp.float8_e4m3fn:  # an FP8 cache (scale 1.0): dequantized on read
            kv = kv.astype(q_lat.dtype)
        s = jnp.einsum("bhr,blr->bhl", ql, kv[..., :R], preferred_element_type=jnp.float32)
        s = s + jnp.einsum("bhd,bld->bhl", qp, kv[..., R:], preferred_element_type=jnp.float32)
        s = s * scale
        visible = jnp.arange(max_len)[None, :] <= pos[:, None]  # [B, L]
        s = jnp.where(visible[:, None, :], s, MASK_VALUE)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhl,blr->bhr", p.astype(kv.dtype), kv[..., :R], preferred_element_type=jnp.float32)
        return o.astype(q_lat.dtype)

    if T <= token_block or T % token_block:
        return block((q_lat, q_pe, seq_ids, positions))
    nb = T // token_block
    split = lambda x: x.reshape(nb, token_block, *x.shape[1:])  # noqa: E731  [T, ...] -> [nb, blk, ...]
    out = jax.lax.map(block, (split(q_lat), split(q_pe), split(seq_ids), split(positions)))
    return out.reshape(T, H, R)
