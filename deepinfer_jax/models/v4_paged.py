"""DeepSeek-V4 through the engine: the family's paged cache and its forward over one ragged step.

The cache is token-granular, one entry per layer and token slot, so the scheduler's single page table per
sequence, its page accounting, prefix caching (an entry depends only on the tokens up to it) and preemption
(recompute) hold unchanged. A token's entry of layer i holds what later tokens need of it:
  every layer: the roped K = V row `raw` [hd] (the sliding window reads it);
  CSA / HCA layers: the compressor's projections `kv`, `gate` [c*hd] (c = 2 for CSA, 1 for HCA), from which
    every compressed row is pooled once its window closes;
  CSA layers: the indexer's projections `idx_kv`, `idx_gate` [2*di] (its keys are pooled likewise).
Layout: kv_cache [L, num_pages, page_size, W], W the widest layer's entry (raw, kv, gate, idx_kv, idx_gate
concatenated; a narrower layer leaves the tail unused). Page 0 is the null page, as for every family.

A step writes its tokens' entries at their slots, gathers each sequence's pages into a contiguous history
[S, max_pages * page_size, W] (row j = position j), pools the compressed rows of that history (a row is seen
only once its window is wholly at or before the query, so rows of unwritten slots are never visible), and
attends each token over its own sequence's history: the same arithmetic as `v4_attention` with a cache,
so chunks may end anywhere inside a compression window. This is the reference path (pure JAX gathers,
recomputing the pooled rows each step); docs/v4.md says what the memory-efficient per-group layout adds.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.config_v4 import CSA, SLIDING, V4Config
from deepinfer_jax.models.cache import StepMetadata
from deepinfer_jax.models.deepseek_v4 import hc_merge, hc_mix, hyper_head, v4_forward, v4_moe
from deepinfer_jax.models.layers import linear, rms_norm
from deepinfer_jax.models.v4_attention import attend, attention_inputs, closed_rows, indexer_select, pool_rows
from deepinfer_jax.models.v4_params import v4_param_specs

ATTN_IMPLS = ("reference",)


def entry_widths(cfg: V4Config, layer_type: str) -> tuple[tuple[str, int], ...]:
    """The fields of one token's cache entry of a layer of `layer_type`, in order, with their widths."""
    hd, di = cfg.head_dim, cfg.index_head_dim
    fields = [("raw", hd)]
    if layer_type != SLIDING:
        w = (2 if layer_type == CSA else 1) * hd
        fields += [("kv", w), ("gate", w)]
    if layer_type == CSA:
        fields += [("idx_kv", 2 * di), ("idx_gate", 2 * di)]
    return tuple(fields)


def entry_width(cfg: V4Config) -> int:
    return max(sum(w for _, w in entry_widths(cfg, lt)) for lt in set(cfg.layer_types))


def kv_cache_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    return (cfg.num_hidden_layers, num_pages, page_size, entry_width(cfg.v4))


def param_specs(cfg: ModelConfig) -> Any:
    return v4_param_specs(cfg.v4)


def forward(params: Any, cfg: ModelConfig, token_ids: jax.Array, *,
            attention_mask: jax.Array | None = None) -> jax.Array:
    """token_ids [B, S] -> logits [B, S, V] (fp32), each row from position 0, no cache (`v4_forward`). With right
    padding (attention_mask), a padded slot changes no earlier position (attention is causal)."""
    del attention_mask
    return jax.vmap(lambda t: v4_forward(cfg.v4, params, t))(token_ids)


def _split(entry: jax.Array, fields: tuple[tuple[str, int], ...]) -> dict[str, jax.Array]:
    out, o = {}, 0
    for name, w in fields:
        out[name] = entry[..., o : o + w]
        o += w
    return out


def _layer_attention(cfg: V4Config, i: int, p: dict, x: jax.Array, cache: jax.Array, meta: StepMetadata):
    """Layer i's attention for the step's tokens x [T, D] -> ([T, D], cache with their entries written)."""
    lt, hd, W = cfg.layer_types[i], cfg.head_dim, cache.shape[-1]
    fields = entry_widths(cfg, lt)
    pos = meta.positions
    q_res, q, new, cos, sin = attention_inputs(cfg, lt, p, x, pos)
    entry = jnp.concatenate([new[name] for name, _ in fields], axis=-1)  # [T, w]
    entry = jnp.pad(entry, ((0, 0), (0, W - entry.shape[-1]))).astype(cache.dtype)
    ps = cache.shape[2]
    cache = cache.at[i, meta.slot_mapping // ps, meta.slot_mapping % ps].set(entry)

    S, max_pages = meta.page_table.shape
    hist = _split(cache[i][meta.page_table].reshape(S, max_pages * ps, W), fields)  # [S, Lmax, .] row j = pos j
    Lmax = max_pages * ps
    j = jnp.arange(Lmax)[None, :]
    allowed = (j <= pos[:, None]) & (j > pos[:, None] - cfg.sliding_window)  # [T, Lmax]
    keys = hist["raw"][meta.seq_ids]  # [T, Lmax, hd]
    if lt != SLIDING and Lmax // cfg.compress_rate(lt):
        rate = cfg.compress_rate(lt)
        pool = jax.vmap(lambda kv, g: pool_rows(cfg, p["compressor"], kv, g, hd, rate, overlap=lt == CSA))
        rows = pool(hist["kv"], hist["gate"])[meta.seq_ids]  # [T, R, hd]
        if lt == CSA:
            ipool = jax.vmap(lambda kv, g: pool_rows(cfg, p["indexer"], kv, g, cfg.index_head_dim, rate, True))
            idx_keys = ipool(hist["idx_kv"], hist["idx_gate"])[meta.seq_ids]  # [T, R, di]
            see = jax.vmap(lambda k, xt, qt, pt: indexer_select(cfg, p["indexer"], k, xt[None], qt[None], pt[None])[0])(
                idx_keys, x, q_res, pos)
        else:
            see = closed_rows(pos, rows.shape[1], rate)
        keys = jnp.concatenate([keys, rows.astype(keys.dtype)], axis=1)
        allowed = jnp.concatenate([allowed, see], axis=1)
    return attend(cfg, p, q, keys, allowed, cos, sin, x.dtype), cache


def forward_paged(params: Any, cfg: ModelConfig, kv_cache: jax.Array, meta: StepMetadata, *,
                  moe_impl: str = "ragged", attn_impl: str = "reference", return_routing: bool = False,
                  unroll: Any = 1, mesh_rules: Any = None):
    """-> (logits [S, V] fp32, updated kv_cache) for one ragged step; prefill, chunked prefill and decode alike.
    The routed experts are computed densely (`v4_moe`, the reference), whatever `moe_impl` names; `unroll`
    does not apply (V4's layers differ in kind and run as a Python loop)."""
    del moe_impl, unroll
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl {attn_impl!r} is not available for deepseek_v4; expected one of {ATTN_IMPLS}")
    if mesh_rules is not None:
        raise ValueError("deepseek_v4 runs on one device (no tensor / data / expert parallel layout yet)")
    v4 = cfg.v4
    x = params["embed"][meta.token_ids]  # [T, D]
    streams = jnp.broadcast_to(x[:, None, :], (x.shape[0], v4.hc_mult, x.shape[-1]))
    for i, lp in enumerate(params["layers"]):
        post, comb, collapsed = hc_mix(v4, lp["attn_hc"], streams)
        a, kv_cache = _layer_attention(v4, i, lp["attn"], rms_norm(collapsed, lp["input_layernorm"], v4.rms_norm_eps),
                                       kv_cache, meta)
        streams = hc_merge(post, comb, a, streams)
        post, comb, collapsed = hc_mix(v4, lp["ffn_hc"], streams)
        m = v4_moe(v4, i, lp["moe"], rms_norm(collapsed, lp["post_attention_layernorm"], v4.rms_norm_eps),
                   meta.token_ids)
        streams = hc_merge(post, comb, m, streams)
    h = hyper_head(v4, params["hc_head"], streams[meta.logits_indices])
    logits = linear(rms_norm(h, params["final_norm"], v4.rms_norm_eps), params["lm_head"]).astype(jnp.float32)
    if return_routing:
        return logits, kv_cache, jnp.zeros((0, x.shape[0], 0), jnp.int32)
    return logits, kv_cache

