"""DeepSeek-V4 (V4-Flash, V4-Pro) as pure functions: the whole-sequence reference forward.

`v4_forward(cfg, params, token_ids)` runs one sequence [S] without a cache and returns logits [S, V]:
embed, copy into `hc_mult` residual streams, then per layer two hyper-connection sites (attention,
MoE), the hyper head collapsing the streams, the final norm and the LM head. Attention is in
`v4_attention.py`. It is the numerics reference for a paged V4 path and, by recomputation, a
reference generator (`v4_greedy_generate`).

Hyper-connections (mHC): at each site the streams [S, n, D] give, from one linear of their RMS-normed
concatenation, `pre` (sigmoid, the streams' weights into the sublayer), `post` (2 * sigmoid, where the
sublayer's output goes) and `comb` (an n x n mixer, Sinkhorn-projected towards doubly stochastic);
new streams = post * sublayer(sum_j pre_j x_j) + comb^T x.

MoE: router scores s = scoring_func(x W_gate) (sqrtsoftplus or sigmoid); "moe" layers pick the top-k of s + correction bias,
"hash_moe" layers take the experts of a static token-id table; weights are the picked scores
normalised to sum 1, times routed_scaling_factor. Experts and the shared expert are SwiGLU with the
gate clamped to <= swiglu_limit and up to [-limit, limit]. Routed experts kept in a released format (FP4, or FP8
blocks; weights/v4_native.py) are dequantized whole by the reference; `impl` "pallas" / "pallas_interpret" runs
them through kernels/moe_gmm_quant.py instead, reading the stored bytes (`v4_quant_experts`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.config_v4 import V4Config
from deepinfer_jax.models.layers import linear, rms_norm, weight
from deepinfer_jax.models.moe import local_experts_xla
from deepinfer_jax.models.quant import is_fp8
from deepinfer_jax.models.quant_fp4 import is_fp4
from deepinfer_jax.models.v4_attention import unweighted_rms, v4_attention, v4_layer_cache
from deepinfer_jax.models.v4_parallel import splits_experts, splits_shared, v4_experts_sharded, v4_shared_expert


# ---- hyper-connections ----------------------------------------------------------------------------


def hc_mix(cfg: V4Config, p: dict, streams: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """streams [S, n, D] -> post [S, n], comb [S, n, n] (fp32) and the collapsed input [S, D]."""
    n, eps = cfg.hc_mult, cfg.hc_eps
    flat = unweighted_rms(streams.reshape(streams.shape[0], -1).astype(jnp.float32), cfg.rms_norm_eps)
    mix = flat @ p["fn"]  # [S, (2+n)*n]
    base, scale = p["base"], p["scale"]
    pre = jax.nn.sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps
    post = 2.0 * jax.nn.sigmoid(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    logits = mix[:, 2 * n :].reshape(-1, n, n) * scale[2] + base[2 * n :].reshape(n, n)
    comb = jax.nn.softmax(logits, axis=-1) + eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

    def sinkhorn_step(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    comb = jax.lax.fori_loop(0, cfg.hc_sinkhorn_iters - 1, sinkhorn_step, comb)
    collapsed = jnp.sum(pre[..., None] * streams, axis=1).astype(streams.dtype)
    return post, comb, collapsed


def hc_merge(post: jax.Array, comb: jax.Array, out: jax.Array, streams: jax.Array) -> jax.Array:
    """New streams [S, n, D]: post[k] * out + sum_j comb[j, k] * streams[j]."""
    dt = streams.dtype
    return post.astype(dt)[..., None] * out[:, None, :] + jnp.einsum("sjk,sjd->skd", comb.astype(dt), streams)


def hyper_head(cfg: V4Config, p: dict, streams: jax.Array) -> jax.Array:
    """The final collapse of the streams [S, n, D] -> [S, D]."""
    flat = unweighted_rms(streams.reshape(streams.shape[0], -1).astype(jnp.float32), cfg.rms_norm_eps)
    pre = jax.nn.sigmoid((flat @ p["fn"]) * p["scale"][0] + p["base"]) + cfg.hc_eps  # [S, n]
    return jnp.sum(pre[..., None] * streams, axis=1).astype(streams.dtype)


# ---- MoE ------------------------------------------------------------------------------------------


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def router_scores(cfg: V4Config, logits: jax.Array) -> jax.Array:
    if cfg.scoring_func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    return jax.nn.sigmoid(logits)


def expert_formats(ex: dict):
    """(gate_up format, down format) of kernels/moe_gmm_quant.py for routed experts kept as released (FP4, or FP8
    blocks in HF's orientation), or None (float experts)."""
    from deepinfer_jax.kernels.moe_gmm_quant import WeightFormat

    def fmt(w):
        if is_fp4(w):
            return WeightFormat("fp4", w.group, layout="nk")
        if is_fp8(w):
            return WeightFormat("fp8", w.block[1], w.block[0], layout="nk")
        return None

    f = (fmt(ex["gate_up"]), fmt(ex["down"]))
    return f if None not in f else None


def v4_quant_experts(cfg: V4Config, ex: dict, x: jax.Array, w: jax.Array, idx: jax.Array,
                     interpret: bool) -> jax.Array | None:
    """The routed experts' sum [S, D] through the quantized grouped GEMMs (x [S, D], w / idx [S, k]), the stored
    FP4 / FP8 bytes read in the kernels; None where the formats or shapes are not the kernels' (`supported`)."""
    from deepinfer_jax.kernels.moe_gmm_quant import moe_experts_quant, supported

    fmts = expert_formats(ex)
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    if fmts is None or not supported(*fmts, D, I, idx.size):
        return None
    gu, dn = ex["gate_up"], ex["down"]
    return moe_experts_quant(x, gu.q, gu.scale, dn.q, dn.scale, w, idx.astype(jnp.int32), fmt_gu=fmts[0],
                             fmt_down=fmts[1], swiglu_limit=cfg.swiglu_limit, interpret=interpret)


def v4_moe(cfg: V4Config, layer: int, p: dict, x: jax.Array, token_ids: jax.Array,
           impl: str = "reference", mesh_rules: Any = None) -> jax.Array:
    """Routed experts plus the shared expert. `impl` "reference" / "dense": every expert computed densely (the
    reference); "pallas" / "pallas_interpret": quantized experts through the kernels where they take them, else
    (and with "ragged") the routed token copies in XLA's grouped GEMM (`moe.local_experts_xla`).
    x [S, D], token_ids [S] -> [S, D]. `mesh_rules` splitting the experts or their intermediate dim: the routed
    experts run on each device's slice (models/v4_parallel.py; `impl` "ragged", "dense" or a Pallas one there), and
    the shared expert on its slice of I where the rules split "mlp", its partial sums in the same reduction."""
    E, lim = cfg.n_routed_experts, cfg.swiglu_limit
    scores = router_scores(cfg, linear(x, p["gate"]).astype(jnp.float32))  # [S, E]
    if cfg.mlp_type(layer) == "hash_moe":
        idx = p["tid2eid"][token_ids]  # [S, k]
    else:
        _, idx = jax.lax.top_k(scores + p["e_score_correction_bias"], cfg.num_experts_per_tok)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
    act = functools.partial(clamped_swiglu, limit=lim)
    if splits_experts(mesh_rules):  # the shared expert inside too where the rules split its width ("mlp")
        fused = splits_shared(mesh_rules)
        routed = v4_experts_sharded(cfg, mesh_rules, impl, p["experts"], x, w, idx, act, expert_formats(p["experts"]),
                                    p["shared"] if fused else None)
        return routed if fused else routed + v4_shared_expert(p["shared"], x, act)
    shared = v4_shared_expert(p["shared"], x, act)
    if impl in ("pallas", "pallas_interpret"):
        routed = v4_quant_experts(cfg, p["experts"], x, w, idx, impl == "pallas_interpret")
        if routed is not None:
            return routed + shared
    if impl not in ("reference", "dense"):  # the routed copies only, in a grouped GEMM (not every expert)
        return local_experts_xla("ragged", p["experts"], x, w, idx, None, act=act).astype(x.dtype) + shared
    dense_w = jnp.sum(jax.nn.one_hot(idx, E, dtype=jnp.float32) * w[..., None], axis=1)  # [S, E]
    gu = jnp.einsum("sd,edgi->segi", x, weight(p["experts"]["gate_up"], x.dtype))  # [S, E, 2, I]
    h = clamped_swiglu(gu[..., 0, :], gu[..., 1, :], lim)
    y = jnp.einsum("sei,eid->sed", h, weight(p["experts"]["down"], x.dtype))
    routed = jnp.einsum("se,sed->sd", dense_w.astype(x.dtype), y)
    return routed + shared


# ---- the model ------------------------------------------------------------------------------------


def v4_block(cfg: V4Config, i: int, lp: dict, streams: jax.Array, token_ids: jax.Array, positions: jax.Array,
             cache: dict | None = None, start: jax.Array | None = None) -> tuple[jax.Array, dict | None]:
    """Layer i (a main layer, or an MTP block at i = num_hidden_layers + j) over streams [S, n, D] -> (streams,
    its cache updated)."""
    post, comb, collapsed = hc_mix(cfg, lp["attn_hc"], streams)
    a, c = v4_attention(cfg, i, lp["attn"], rms_norm(collapsed, lp["input_layernorm"], cfg.rms_norm_eps),
                        positions, cache, start)
    streams = hc_merge(post, comb, a, streams)
    post, comb, collapsed = hc_mix(cfg, lp["ffn_hc"], streams)
    m = v4_moe(cfg, i, lp["moe"], rms_norm(collapsed, lp["post_attention_layernorm"], cfg.rms_norm_eps), token_ids)
    return hc_merge(post, comb, m, streams), c


def v4_streams(cfg: V4Config, params: Any, token_ids: jax.Array, positions: jax.Array | None = None,
               caches: list | None = None, start: jax.Array | None = None) -> tuple[jax.Array, list | None]:
    """The last layer's residual streams [S, n, D] of token_ids [S] (before the hyper head): the whole sequence
    (no caches; positions default to 0..S-1), or a chunk at `start` over per-layer caches (`v4_init_caches`),
    returned updated."""
    S = token_ids.shape[0]
    if positions is None:
        positions = jnp.arange(S) if start is None else start + jnp.arange(S)
    x = params["embed"][token_ids]  # [S, D]
    streams = jnp.broadcast_to(x[:, None, :], (S, cfg.hc_mult, x.shape[-1]))
    new_caches = []
    for i, lp in enumerate(params["layers"]):
        streams, c = v4_block(cfg, i, lp, streams, token_ids, positions, None if caches is None else caches[i], start)
        new_caches.append(c)
    return streams, (None if caches is None else new_caches)


def v4_hidden(cfg: V4Config, params: Any, token_ids: jax.Array, positions: jax.Array | None = None,
              caches: list | None = None, start: jax.Array | None = None) -> tuple[jax.Array, list | None]:
    """The final hidden states [S, D] of token_ids [S] (`v4_streams`, then the hyper head and the final norm)."""
    streams, caches = v4_streams(cfg, params, token_ids, positions, caches, start)
    return rms_norm(hyper_head(cfg, params["hc_head"], streams), params["final_norm"], cfg.rms_norm_eps), caches


# ---- the MTP layer (DeepSeek's MTPBlock) ------------------------------------------------------------


def v4_mtp_input(cfg: V4Config, mp: dict, embed: jax.Array, streams: jax.Array, next_ids: jax.Array) -> jax.Array:
    """The MTP block's input streams [S, n, D]: e_proj(enorm(embed(t_{i+1}))) added to each of h_proj(hnorm(.)) of
    the main model's last streams [S, n, D] (or the previous MTP pass's output) at position i."""
    e = linear(rms_norm(embed[next_ids], mp["enorm"], cfg.rms_norm_eps), mp["e_proj"])  # [S, D]
    h = linear(rms_norm(streams.astype(e.dtype), mp["hnorm"], cfg.rms_norm_eps), mp["h_proj"])  # [S, n, D]
    return e[:, None, :] + h


def v4_mtp_logits(cfg: V4Config, params: Any, streams: jax.Array, j: int = 0) -> jax.Array:
    """The MTP block's output streams [S, n, D] -> logits [S, V] fp32: its own hyper head and norm, the shared head."""
    mp = params["mtp"][j]
    h = rms_norm(hyper_head(cfg, mp["hc_head"], streams), mp["norm"], cfg.rms_norm_eps)
    return linear(h, params["lm_head"]).astype(jnp.float32)


def v4_mtp_forward(cfg: V4Config, params: Any, token_ids: jax.Array, j: int = 0) -> jax.Array:
    """The reference of MTP layer j (first layer only: j = 0, its input the main model's streams) on one whole
    sequence token_ids [S]: logits [S, V] of the token at i + 2 from the streams at i and the token at i + 1 (the
    last position's next token is taken as token 0; its logits mean nothing)."""
    streams, _ = v4_streams(cfg, params, token_ids)
    nxt = jnp.concatenate([token_ids[1:], token_ids[:1] * 0])
    x = v4_mtp_input(cfg, params["mtp"][j], params["embed"], streams, nxt)
    x, _ = v4_block(cfg, cfg.num_hidden_layers + j, params["mtp"][j]["layer"], x, nxt, jnp.arange(token_ids.shape[0]))
    return v4_mtp_logits(cfg, params, x, j)


def v4_forward(cfg: V4Config, params: Any, token_ids: jax.Array) -> jax.Array:
    """Logits [S, V] (fp32) of one sequence token_ids [S], every position, no cache."""
    h, _ = v4_hidden(cfg, params, token_ids)
    return linear(h, params["lm_head"]).astype(jnp.float32)


def v4_init_caches(cfg: V4Config, capacity: int, dtype: Any = jnp.float32) -> list:
    """Empty contiguous per-layer caches for one sequence of up to `capacity` tokens."""
    return [v4_layer_cache(cfg, i, capacity, dtype) for i in range(cfg.num_hidden_layers)]


def v4_forward_chunk(cfg: V4Config, params: Any, caches: list, token_ids: jax.Array,
                     start: jax.Array) -> tuple[jax.Array, list]:
    """Logits [S, V] of a chunk token_ids [S] at positions start..start+S-1 of a sequence whose first
    `start` tokens are in `caches`, and the caches with the chunk written. Chunked prefill and decode
    (S = 1) alike: chunks may end anywhere inside a compression window. The caller keeps
    start + S <= the caches' capacity (a traced `start` cannot be checked here; XLA would clamp it)."""
    h, caches = v4_hidden(cfg, params, token_ids, caches=caches, start=start)
    return linear(h, params["lm_head"]).astype(jnp.float32), caches


def v4_greedy_generate(cfg: V4Config, params: Any, buffer: jax.Array, prompt_len: jax.Array,
                       max_new_tokens: int) -> jax.Array:
    """Greedy decoding by recomputation, the reference generator: each new token is the argmax of the
    whole-sequence forward at the last filled position. buffer [L] int32 holds the prompt in its first
    `prompt_len` slots; the caller keeps L >= prompt_len + max_new_tokens (JAX drops an out-of-range
    write); returns the buffer with the new tokens written.

    The forward runs over all L slots every step; slots past the last filled one change no earlier
    position (attention is causal, a compressed row is seen only once its whole window is filled, the
    indexer never picks an unready row, and the MoE is per token), so one compiled shape serves every
    step."""

    def step(k, buf):
        n = prompt_len + k
        logits = v4_forward(cfg, params, buf)  # [L, V]
        nxt = jnp.argmax(logits[n - 1]).astype(buf.dtype)
        return buf.at[n].set(nxt)

    return jax.lax.fori_loop(0, max_new_tokens, step, buffer)
