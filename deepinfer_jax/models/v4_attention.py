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
from deepinfer_jax.models.layers import apply_rope, linear, rms_norm


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


def pool_windows(cfg: V4Config, p: dict, x: jax.Array, width: int, rate: int, overlap: bool) -> jax.Array:
    """Compressed rows [S // rate, width] of x [S, D]: each closed window of `rate` tokens pools its
    projected rows with a softmax (over the window's slots, per channel) of the gate plus the learned
    position bias, then RMSNorm and the compress rope at the window's first position.

    overlap (CSA): the projections are 2 * width wide, series a = [:width] and b = [width:]; row w pools
    series a of window w-1 (none for w = 0) and series b of window w over 2 * rate slots."""
    S = x.shape[0]
    n = S // rate
    kv = linear(x[: n * rate], p["kv_proj"]).reshape(n, rate, -1)  # [n, m, c*width]
    gate = linear(x[: n * rate], p["gate_proj"]).reshape(n, rate, -1).astype(jnp.float32)
    gate = gate + p["position_bias"].astype(jnp.float32)
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


def indexer_select(cfg: V4Config, p: dict, x: jax.Array, q_res: jax.Array, positions: jax.Array) -> jax.Array:
    """The lightning indexer's choice [S, T] (bool) of compressed CSA rows per query: the top
    `index_topk` of sum_h w[t, h] * relu(q[t, h] . k[s]) among the rows whose window is closed."""
    rate, di = cfg.compress_rate(CSA), cfg.index_head_dim
    keys = pool_windows(cfg, p, x, di, rate, overlap=True)  # [T, di]
    T = keys.shape[0]
    q = jnp.einsum("sr,rhd->shd", q_res, p["q_b_proj"].astype(q_res.dtype))  # [S, nI, di]
    cos, sin = v4_cos_sin(cfg, "compress", positions)
    q = rope_tail(q, cos, sin)
    scores = jax.nn.relu(jnp.einsum("shd,td->sht", q.astype(jnp.float32), keys.astype(jnp.float32)))
    scores = scores * di**-0.5
    weights = linear(x, p["weights_proj"]).astype(jnp.float32) * cfg.index_n_heads**-0.5  # [S, nI]
    index_scores = jnp.einsum("sht,sh->st", scores, weights)
    ready = jnp.arange(T)[None, :] < ((positions + 1) // rate)[:, None]  # [S, T]
    index_scores = jnp.where(ready, index_scores, -jnp.inf)
    _, top = jax.lax.top_k(index_scores, min(cfg.index_topk, T))  # [S, k]
    chosen = jnp.any(jax.nn.one_hot(top, T, dtype=jnp.bool_), axis=1)
    return chosen & ready


# ---- the attention layer --------------------------------------------------------------------------


def v4_attention(cfg: V4Config, layer: int, p: dict, x: jax.Array, positions: jax.Array) -> jax.Array:
    """One V4 attention layer over a whole sequence. x [S, D], positions [S] -> [S, D]."""
    lt = cfg.layer_types[layer]
    S, H, hd = x.shape[0], cfg.num_attention_heads, cfg.head_dim
    kind = "main" if lt == SLIDING else "compress"
    cos, sin = v4_cos_sin(cfg, kind, positions)

    q_res = rms_norm(linear(x, p["q_a_proj"]), p["q_a_norm"], cfg.rms_norm_eps)  # [S, Rq]
    q = jnp.einsum("sr,rhd->shd", q_res, p["q_b_proj"].astype(x.dtype))  # [S, H, hd]
    q = rope_tail(unweighted_rms(q, cfg.rms_norm_eps), cos, sin)
    kv = rope_tail(rms_norm(linear(x, p["kv_proj"]), p["kv_norm"], cfg.rms_norm_eps), cos, sin)  # [S, hd]

    i, j = positions[:, None], positions[None, :]
    allowed = (j <= i) & (j > i - cfg.sliding_window)  # [S, S] raw rows in the window
    keys = kv
    if lt != SLIDING:
        rate = cfg.compress_rate(lt)
        rows = pool_windows(cfg, p["compressor"], x, hd, rate, overlap=lt == CSA)  # [T, hd]
        T = rows.shape[0]
        if T:
            if lt == CSA:
                see = indexer_select(cfg, p["indexer"], x, q_res, positions)
            else:
                see = jnp.arange(T)[None, :] < ((positions + 1) // rate)[:, None]
            keys = jnp.concatenate([kv, rows.astype(kv.dtype)], axis=0)
            allowed = jnp.concatenate([allowed, see], axis=1)

    logits = jnp.einsum("shd,td->hst", q.astype(jnp.float32), keys.astype(jnp.float32)) * hd**-0.5
    logits = jnp.where(allowed[None], logits, -jnp.inf)
    sinks = jnp.broadcast_to(p["sinks"].astype(jnp.float32)[:, None, None], (H, S, 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sinks], axis=-1), axis=-1)[..., :-1]
    out = jnp.einsum("hst,td->shd", probs, keys.astype(jnp.float32)).astype(x.dtype)  # [S, H, hd]
    out = rope_tail(out, cos, -sin)  # undo the rotation V (= K) carried

    g = cfg.o_groups
    grouped = jnp.einsum("sgi,gir->sgr", out.reshape(S, g, -1), p["o_a_proj"].astype(x.dtype))
    return linear(grouped.reshape(S, -1), p["o_b_proj"])
