"""DeepSeek-V4 attention over a whole sequence (no cache): the pure reference of the hybrid layers.

One layer sees a sequence x [S, D] (the normed input of the attention site) at positions [S] and
returns [S, D]. Every layer keeps the raw rows of the last `sliding_window` tokens; CSA and HCA layers
add compressed rows, one per `m` source tokens, pooled by a softmax gate over each window:
  HCA: row w pools tokens [w*m, (w+1)*m) and every query past the window sees it.
  CSA: row w pools two series over 2m slots, series a of window w-1 and series b of window w
       (overlapping windows, stride m); the lightning indexer then keeps `index_topk` rows per query.
Queries, keys and compressed rows share one head (K = V, `head_dim`), with interleaved RoPE on the
trailing `qk_rope_head_dim` channels; the output's rope slice is rotated back by the query position.
Per-head sinks add one logit to every softmax; the output projection is grouped and low-rank.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config_v4 import CSA, SLIDING, V4Config
from deepinfer_jax.models.layers import apply_rope, linear, rms_norm, weight
from deepinfer_jax.models.quant import is_fp8


# ---- rotary ---------------------------------------------------------------------------------------


def v4_inv_freq(cfg: V4Config, kind: str) -> np.ndarray:
    """[qk_rope_head_dim // 2] fp32 inverse frequencies of the "main" (sliding layers) or "compress"
    (CSA / HCA layers, their compressors and indexer) rope; YaRN-blended on compress when configured,
    with attention factor 1.0 (the cos / sin amplitude stays 1)."""
    d = cfg.qk_rope_head_dim
    base = cfg.rope_theta if kind == "main" else cfg.compress_rope_theta
    freqs = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.compress_rope_scaling if kind == "compress" else None
    if rs is None:
        return freqs.astype(np.float32)

    def corr_dim(num_rot: float) -> float:
        return d * math.log(rs.original_max_position_embeddings / (num_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(rs.beta_fast)), 0)
    high = min(math.ceil(corr_dim(rs.beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return (freqs / rs.factor * ramp + freqs * (1.0 - ramp)).astype(np.float32)


def v4_cos_sin(cfg: V4Config, kind: str, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [...] -> cos, sin [..., qk_rope_head_dim // 2] fp32."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(v4_inv_freq(cfg, kind))
    return jnp.cos(angles), jnp.sin(angles)


def rope_tail(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Interleaved RoPE on the trailing 2 * cos.shape[-1] channels of x [S, ..., d]; the rest untouched."""
    rd = 2 * cos.shape[-1]
    return jnp.concatenate([x[..., :-rd], apply_rope(x[..., -rd:], cos, sin)], axis=-1)


def unweighted_rms(x: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


# ---- compressors ----------------------------------------------------------------------------------


def project(p: dict, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A compressor's (or the indexer's) per-token projections of x [S, D]: kv, gate [S, c*width]."""
    return linear(x, p["kv_proj"]), linear(x, p["gate_proj"])


def pool_rows(cfg: V4Config, p: dict, kv: jax.Array, gate: jax.Array, width: int, rate: int,
              overlap: bool) -> jax.Array:
    """Compressed rows [S // rate, width] from per-token projections kv, gate [S, c*width] of positions
    0..S-1: each window of `rate` tokens pools its kv rows with a softmax (over the window's slots, per
    channel) of the gate plus the learned position bias, then RMSNorm and the compress rope at the
    window's first position. A row whose window is not yet filled is computed but never visible.

    overlap (CSA): c = 2, series a = [:width] and b = [width:]; row w pools series a of window w-1 (none
    for w = 0) and series b of window w over 2 * rate slots."""
    n = kv.shape[0] // rate
    kv = kv[: n * rate].reshape(n, rate, -1)  # [n, m, c*width]
    gate = gate[: n * rate].reshape(n, rate, -1).astype(jnp.float32) + p["position_bias"].astype(jnp.float32)
    if overlap:
        a_kv, b_kv = kv[..., :width], kv[..., width:]
        a_g, b_g = gate[..., :width], gate[..., width:]
        prev_kv = jnp.concatenate([jnp.zeros_like(a_kv[:1]), a_kv[:-1]], axis=0)
        prev_g = jnp.concatenate([jnp.full_like(a_g[:1], -jnp.inf), a_g[:-1]], axis=0)
        kv = jnp.concatenate([prev_kv, b_kv], axis=1)  # [n, 2m, width]
        gate = jnp.concatenate([prev_g, b_g], axis=1)
    w = jax.nn.softmax(gate, axis=1).astype(kv.dtype)
    pooled = rms_norm(jnp.sum(kv * w, axis=1), p["kv_norm"], cfg.rms_norm_eps)  # [n, width]
    cos, sin = v4_cos_sin(cfg, "compress", jnp.arange(n) * rate)
    return rope_tail(pooled, cos, sin)


def closed_rows(positions: jax.Array, num_rows: int, rate: int) -> jax.Array:
    """[S, T] bool: query at `pos` may see row w once its window is wholly in the past, w < (pos+1) // rate."""
    return jnp.arange(num_rows)[None, :] < ((positions + 1) // rate)[:, None]


def indexer_queries(cfg: V4Config, p: dict, x: jax.Array, q_res: jax.Array,
                    positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The lightning indexer's roped queries [S, nI, di] and head weights [S, nI] (fp32, nI^-0.5 folded in)."""
    q = jnp.einsum("sr,rhd->shd", q_res, weight(p["q_b_proj"], q_res.dtype))  # [S, nI, di]
    cos, sin = v4_cos_sin(cfg, "compress", positions)
    weights = linear(x, p["weights_proj"]).astype(jnp.float32) * cfg.index_n_heads**-0.5  # [S, nI]
    return rope_tail(q, cos, sin), weights


def indexer_scores(cfg: V4Config, p: dict, keys: jax.Array, x: jax.Array, q_res: jax.Array,
                   positions: jax.Array) -> jax.Array:
    """The lightning indexer's scores [S, T] fp32 of compressed CSA rows keys [T, di] for queries (x, q_res [S, .]):
    sum_h w[t, h] * relu(q[t, h] . keys[s]) * di^-0.5, -inf at rows whose window is not closed."""
    q, weights = indexer_queries(cfg, p, x, q_res, positions)
    scores = jax.nn.relu(jnp.einsum("shd,td->sht", q.astype(jnp.float32), keys.astype(jnp.float32)))
    scores = scores * cfg.index_head_dim**-0.5
    index_scores = jnp.einsum("sht,sh->st", scores, weights)
    ready = closed_rows(positions, keys.shape[0], cfg.compress_rate(CSA))
    return jnp.where(ready, index_scores, -jnp.inf)


def indexer_select(cfg: V4Config, p: dict, keys: jax.Array, x: jax.Array, q_res: jax.Array,
                   positions: jax.Array) -> jax.Array:
    """The lightning indexer's choice [S, T] (bool) of compressed CSA rows per query (x, q_res [S, .]):
    the top `index_topk` of `indexer_scores` among the rows whose window is closed."""
    T = keys.shape[0]
    _, top = jax.lax.top_k(indexer_scores(cfg, p, keys, x, q_res, positions), min(cfg.index_topk, T))  # [S, k]
    chosen = jnp.any(jax.nn.one_hot(top, T, dtype=jnp.bool_), axis=1)
    return chosen & closed_rows(positions, T, cfg.compress_rate(CSA))


# ---- the attention layer --------------------------------------------------------------------------


def v4_layer_cache(cfg: V4Config, layer: int, capacity: int, dtype=jnp.float32) -> dict:
    """An empty contiguous cache of one layer for `capacity` tokens: the raw K = V rows and, for CSA /
    HCA layers, the compressors' per-token projections (the `*_state` groups of `v4_cache_groups`,
    unwindowed here), from which the compressed rows are pooled."""
    lt, hd, di = cfg.attn_type(layer), cfg.head_dim, cfg.index_head_dim
    c = {"raw": jnp.zeros((capacity, hd), dtype)}
    if lt != SLIDING:
        w = (2 if lt == CSA else 1) * hd
        c["kv"], c["gate"] = jnp.zeros((capacity, w), dtype), jnp.zeros((capacity, w), dtype)
    if lt == CSA:
        c["idx_kv"], c["idx_gate"] = jnp.zeros((capacity, 2 * di), dtype), jnp.zeros((capacity, 2 * di), dtype)
    return c


def v4_attention(cfg: V4Config, layer: int, p: dict, x: jax.Array, positions: jax.Array,
                 cache: dict | None = None, start: jax.Array | None = None) -> tuple[jax.Array, dict | None]:
    """One V4 attention layer. x [S, D] at positions [S] -> ([S, D], cache').

    Without a cache, x is the whole sequence from position 0. With one (`v4_layer_cache`), x is a chunk
    at positions start..start+S-1: its rows and projections are written at `start` and the chunk
    attends over everything written so far, so a chunk that ends mid-window leaves the open window's
    projections for the chunk that closes it."""
    lt = cfg.attn_type(layer)
    hd = cfg.head_dim
    q_res, new, cos, sin = attention_inputs(cfg, lt, p, x, positions)
    q = queries(cfg, p["q_b_proj"], q_res, cos, sin, x.dtype)  # [S, H, hd]
    if cache is None:
        buf = new
    else:
        buf = {k: jax.lax.dynamic_update_slice(cache[k], v.astype(cache[k].dtype), (start, 0)) for k, v in new.items()}

    keys = buf["raw"]  # [L, hd], row j at position j
    i, j = positions[:, None], jnp.arange(keys.shape[0])[None, :]
    allowed = (j <= i) & (j > i - cfg.sliding_window)  # [S, L] raw rows in the window
    if lt != SLIDING:
        rate = cfg.compress_rate(lt)
        rows = pool_rows(cfg, p["compressor"], buf["kv"], buf["gate"], hd, rate, overlap=lt == CSA)  # [T, hd]
        T = rows.shape[0]
        if T:
            if lt == CSA:
                idx_keys = pool_rows(cfg, p["indexer"], buf["idx_kv"], buf["idx_gate"], cfg.index_head_dim, rate, True)
                see = indexer_select(cfg, p["indexer"], idx_keys, x, q_res, positions)
            else:
                see = closed_rows(positions, T, rate)
            keys = jnp.concatenate([keys, rows.astype(keys.dtype)], axis=0)
            allowed = jnp.concatenate([allowed, see], axis=1)

    return attend(cfg, p, q, keys, allowed, cos, sin, x.dtype), (None if cache is None else buf)


def attention_inputs(cfg: V4Config, lt: str, p: dict, x: jax.Array, positions: jax.Array):
    """x [S, D] at positions [S] of a layer of type `lt` -> (q_res [S, Rq] (the queries: `queries`), the per-token
    cache entries {raw [S, hd] (the roped K = V row), kv / gate (CSA, HCA: the compressor's projections),
    idx_kv / idx_gate (CSA: the indexer's)}, cos, sin [S, rope / 2])."""
    kind = "main" if lt == SLIDING else "compress"
    cos, sin = v4_cos_sin(cfg, kind, positions)
    q_res = rms_norm(linear(x, p["q_a_proj"]), p["q_a_norm"], cfg.rms_norm_eps)  # [S, Rq]
    kv = rope_tail(rms_norm(linear(x, p["kv_proj"]), p["kv_norm"], cfg.rms_norm_eps), cos, sin)  # [S, hd]
    new = {"raw": kv}
    if lt != SLIDING:
        new["kv"], new["gate"] = project(p["compressor"], x)
    if lt == CSA:
        new["idx_kv"], new["idx_gate"] = project(p["indexer"], x)
    return q_res, new, cos, sin


def queries(cfg: V4Config, q_b_proj, q_res: jax.Array, cos: jax.Array, sin: jax.Array, dtype) -> jax.Array:
    """The roped queries [S, H, hd] of q_res [S, Rq] through q_b_proj [Rq, H, hd] (or a device's heads of it)."""
    q = jnp.einsum("sr,rhd->shd", q_res, weight(q_b_proj, dtype))
    return rope_tail(unweighted_rms(q, cfg.rms_norm_eps), cos, sin)


def attend(cfg: V4Config, p: dict, q: jax.Array, keys: jax.Array, allowed: jax.Array, cos: jax.Array,
           sin: jax.Array, dtype) -> jax.Array:
    """q [S, H, hd] over keys (= values) [S or 1, T, hd] where allowed [S or 1, T] (the sinks add one logit to
    each softmax), the output's rope slice rotated back, then the grouped low-rank projection -> [S, D]."""
    S, H, hd = q.shape
    keys = jnp.broadcast_to(keys, (S,) + keys.shape[-2:]).astype(jnp.float32)
    logits = jnp.einsum("shd,std->hst", q.astype(jnp.float32), keys) * hd**-0.5
    logits = jnp.where(jnp.broadcast_to(allowed, (S, keys.shape[1]))[None], logits, -jnp.inf)
    sinks = jnp.broadcast_to(p["sinks"].astype(jnp.float32)[:, None, None], (H, S, 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sinks], axis=-1), axis=-1)[..., :-1]
    return attend_output(cfg, p, jnp.einsum("hst,std->shd", probs, keys).astype(dtype), cos, sin, dtype)


def attend_output(cfg: V4Config, p: dict, out: jax.Array, cos: jax.Array, sin: jax.Array, dtype) -> jax.Array:
    """The attention's heads out [S, H, hd]: the rope slice rotated back, then the grouped low-rank projection."""
    S = out.shape[0]
    out = rope_tail(out, cos, -sin)  # undo the rotation V (= K) carried

    wa = p["o_a_proj"]  # [g, H*hd/g, r]; an FP8 one is [H*hd/g, g, r] (weights/v4_native.py)
    wa = jnp.moveaxis(weight(wa, dtype), 0, 1) if is_fp8(wa) else wa.astype(dtype)
    g = wa.shape[0]  # o_groups, or a device's share of them with its heads (models/v4_parallel.py)
    grouped = jnp.einsum("sgi,gir->sgr", out.reshape(S, g, -1), wa)
    return linear(grouped.reshape(S, -1), p["o_b_proj"])
